//! The extender's HTTP endpoints, as kube-scheduler's `extenders` entry
//! names them (`urlPrefix` + `filterVerb` / `prioritizeVerb` /
//! `bindVerb`): `POST /filter`, `/prioritize`, `/bind`; `GET /healthz`
//! (the caches have listed).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::api::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, HostPriority,
};
use crate::bind::BindApi;
use crate::kube_api::ClusterSource;
use crate::policy::Policy;

/// What the endpoints serve from.
pub struct Server {
    pub source: Arc<dyn ClusterSource>,
    pub binder: Arc<dyn BindApi>,
    /// The cluster's default policy (a pod's annotation overrides it).
    pub policy: Policy,
}

/// `GET /healthz` alone, for probes on a listener of their own: the
/// kubelet's probes carry no client certificate, and a flood on the
/// extender's port must not fail them.
pub fn health_router(s: Arc<Server>) -> Router {
    Router::new().route("/healthz", get(healthz)).with_state(s)
}

pub fn router(s: Arc<Server>) -> Router {
    Router::new()
        .route("/filter", post(filter))
        .route("/prioritize", post(prioritize))
        .route("/bind", post(bind))
        .route("/healthz", get(healthz))
        .with_state(s)
}

async fn filter(
    State(s): State<Arc<Server>>,
    Json(args): Json<ExtenderArgs>,
) -> Json<ExtenderFilterResult> {
    if !s.source.ready() {
        return Json(ExtenderFilterResult {
            error: "vcuda-scheduler: the node and pod caches have not listed yet".into(),
            ..Default::default()
        });
    }
    Json(crate::extender::filter(&s.source.cluster(), &args))
}

async fn prioritize(
    State(s): State<Arc<Server>>,
    Json(args): Json<ExtenderArgs>,
) -> Result<Json<Vec<HostPriority>>, (StatusCode, String)> {
    crate::extender::prioritize(&s.source.cluster(), &args, s.policy)
        .map(Json)
        .map_err(|e| (StatusCode::BAD_REQUEST, e))
}

async fn bind(
    State(s): State<Arc<Server>>,
    Json(args): Json<ExtenderBindingArgs>,
) -> Json<ExtenderBindingResult> {
    Json(crate::bind::bind(s.binder.as_ref(), &args, s.policy).await)
}

async fn healthz(State(s): State<Arc<Server>>) -> (StatusCode, &'static str) {
    if s.source.ready() {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "caches not listed yet\n")
    }
}
