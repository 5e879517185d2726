//! The endpoints the API server calls: `POST /validate` and `/mutate`
//! (AdmissionReview v1 of pods), and `GET /healthz` on a listener of its
//! own for the kubelet's probes.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

use crate::mutate::{self, Settings};
use crate::review::{Request, Review, Verdict, reply};
use crate::validate::{self, Trusted};
use crate::world::{Nodes, Templates};

pub struct Webhook {
    pub nodes: Arc<dyn Nodes>,
    pub templates: Arc<dyn Templates>,
    pub settings: Settings,
    pub trusted: Trusted,
}

pub fn router(w: Arc<Webhook>) -> Router {
    Router::new()
        .route("/validate", post(validate))
        .route("/mutate", post(mutate))
        .with_state(w)
}

pub fn health_router(w: Arc<Webhook>) -> Router {
    Router::new().route("/healthz", get(healthz)).with_state(w)
}

async fn healthz(State(w): State<Arc<Webhook>>) -> (StatusCode, &'static str) {
    if w.nodes.ready() {
        (StatusCode::OK, "ok")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the node list has not been read yet",
        )
    }
}

/// A review without a request, or a body that is no review: a 400 the
/// API server logs, naming what was wrong.
type Answer = Result<Json<Value>, (StatusCode, String)>;

fn parse(body: &Value) -> Result<(String, Request), (StatusCode, String)> {
    let review: Review = serde_json::from_value(body.clone()).map_err(|e| {
        (
            StatusCode::BAD_REQUEST,
            format!("not an AdmissionReview: {e}"),
        )
    })?;
    let req = review.request.ok_or((
        StatusCode::BAD_REQUEST,
        "AdmissionReview without a request".to_string(),
    ))?;
    Ok((review.api_version, req))
}

fn pod(v: Option<&Value>) -> Option<Pod> {
    serde_json::from_value(v?.clone()).ok()
}

async fn validate(State(w): State<Arc<Webhook>>, Json(body): Json<Value>) -> Answer {
    let (api_version, req) = parse(&body)?;
    let verdict = w.validate(&req);
    Ok(Json(reply(&api_version, &req.uid, &verdict)))
}

async fn mutate(State(w): State<Arc<Webhook>>, Json(body): Json<Value>) -> Answer {
    let (api_version, req) = parse(&body)?;
    let verdict = w.mutate(&req).await;
    Ok(Json(reply(&api_version, &req.uid, &verdict)))
}

impl Webhook {
    /// Requests no node can place, and placement annotations from anyone
    /// but vcuda.
    pub fn validate(&self, req: &Request) -> Verdict {
        let Some(p) = pod(req.object.as_ref()) else {
            return Verdict::Allow;
        };
        let old = pod(req.old_object.as_ref());
        if let Err(e) = validate::check_placement_writer(
            &p,
            old.as_ref(),
            &req.user_info.username,
            &self.trusted,
        ) {
            return Verdict::Deny(e);
        }
        if req.operation == "CREATE"
            && let Err(e) = validate::check_pod(&p, &self.nodes.gpus())
        {
            return Verdict::Deny(e.to_string());
        }
        Verdict::Allow
    }

    /// The scheduler name and the DRA rewrite of a pod being created; an
    /// invalid request is left for `/validate` to refuse with its reason.
    pub async fn mutate(&self, req: &Request) -> Verdict {
        let Some(p) = pod(req.object.as_ref()) else {
            return Verdict::Allow;
        };
        if req.operation != "CREATE" || validate::check_pod(&p, &self.nodes.gpus()).is_err() {
            return Verdict::Allow;
        }
        let mut p = p;
        // A pod from a generateName has no name yet; messages use the
        // namespace the request names.
        if p.metadata.namespace.is_none() {
            p.metadata.namespace = Some(req.namespace.clone());
        }
        let m = mutate::plan(&p, &self.settings);
        if !req.dry_run {
            for t in &m.templates {
                if let Err(e) = self.templates.ensure(t).await {
                    return Verdict::Deny(format!(
                        "{e}; the pod's vcuda limits become a claim from that template on this DRA cluster, \
                         so it is not admitted without it (does the webhook's ServiceAccount have create on \
                         resourceclaimtemplates?)"
                    ));
                }
            }
        }
        if m.ops.is_empty() {
            Verdict::Allow
        } else {
            Verdict::Patch(m.ops)
        }
    }
}
