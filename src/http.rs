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

use crate::health::Health;
use crate::metrics::Metrics;

#[derive(Clone)]
struct AppState {
    metrics: Metrics,
    health: Arc<Health>,
    /// `timeouts.liveness_stall`: a loop that has not turned this long is
    /// stuck, not busy. Retry waits tick too, so an outage is "not ready",
    /// never "not alive".
    stall: Duration,
}

pub fn router(metrics: Metrics, health: Arc<Health>, stall: Duration) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState {
            metrics,
            health,
            stall,
        })
}

/// Serves until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    health: Arc<Health>,
    stall: Duration,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(metrics, health, stall))
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
    match s.health.liveness(s.stall) {
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
