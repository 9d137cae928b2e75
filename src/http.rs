//! `/metrics` (Prometheus text format), `/healthz` (the loop turns) and
//! `/readyz` (subscribed, MongoDB reachable, not draining), with the reason
//! in the body when the answer is no.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::pipeline::Health;

/// A loop turn takes at most a linger or an idle second, plus a batch
/// write; a minute without one means it is stuck, not busy. Retry sleeps
/// tick too, so an outage is "not ready", never "not alive".
const STALL: Duration = Duration::from_secs(60);

#[derive(Clone)]
struct AppState {
    metrics: Metrics,
    health: Arc<Health>,
}

pub fn router(metrics: Metrics, health: Arc<Health>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState { metrics, health })
}

/// Serves until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(metrics, health))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

async fn metrics_handler(State(s): State<AppState>) -> impl IntoResponse {
    s.metrics.ready.set(i64::from(s.health.readiness().is_ok()));
    (
        [(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)],
        s.metrics.render(),
    )
}

async fn healthz(State(s): State<AppState>) -> impl IntoResponse {
    match s.health.liveness(STALL) {
        Ok(()) => (StatusCode::OK, "ok\n".to_string()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

async fn readyz(State(s): State<AppState>) -> impl IntoResponse {
    match s.health.readiness() {
        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}
