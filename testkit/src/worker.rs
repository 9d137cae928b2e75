//! The worker in this process: started on settings, stopped through its
//! cancellation token, its metrics readable by the test.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tradebucket::config::Settings;
use tradebucket::health::Health;
use tradebucket::metrics::Metrics;
use tradebucket::pipeline::Pipeline;

pub struct Worker {
    token: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
    pub metrics: Metrics,
    /// What `/readyz` and `/healthz` would answer.
    pub health: Arc<Health>,
}

impl Worker {
    /// Starts the pipeline on a task. `TEST_LOG=1` shows its logs.
    pub fn spawn(settings: Settings) -> Worker {
        if std::env::var_os("TEST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new("info,tradebucket=debug"))
                .with_test_writer()
                .try_init();
        }
        let token = CancellationToken::new();
        let metrics = Metrics::new();
        let health = Arc::new(Health::default());
        let (t, m, h) = (token.clone(), metrics.clone(), health.clone());
        let handle = tokio::spawn(async move {
            let pipeline = Pipeline::build(settings, m, h, &t)
                .await
                .expect("worker starts");
            if let Some(p) = pipeline {
                p.run(t).await.expect("the worker runs until stopped");
            }
        });
        Worker {
            token,
            handle,
            metrics,
            health,
        }
    }

    /// Cancels the worker and waits (at most 30 s) for it to drain.
    pub async fn stop(self) -> Metrics {
        self.token.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("worker stops within 30 s")
            .expect("worker task");
        self.metrics
    }
}
