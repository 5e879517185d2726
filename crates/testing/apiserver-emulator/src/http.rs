//! The REST surface: `/api/v1/{pods,nodes}` and `/api/v1/namespaces/{ns}/pods`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::store::{Event, Kind, Shared, StoreError};

#[derive(Clone)]
pub(crate) struct App {
    pub(crate) state: Arc<Shared>,
    cancel: CancellationToken,
}

pub fn router(state: Arc<Shared>, cancel: CancellationToken) -> Router {
    Router::new()
        .route("/version", get(version))
        .route("/api/v1/pods", get(list_all_pods))
        .route(
            "/api/v1/namespaces/{ns}/pods",
            get(list_ns_pods).post(create_pod),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}",
            get(get_pod).patch(patch_pod).delete(delete_pod),
        )
        .route("/api/v1/nodes", get(list_nodes).post(create_node))
        .route("/api/v1/nodes/{name}", get(get_node).patch(patch_node))
        .route("/apis/events.k8s.io/v1/events", get(list_all_events))
        .route(
            "/apis/events.k8s.io/v1/namespaces/{ns}/events",
            get(list_ns_events).post(create_event),
        )
        .merge(crate::resource::routes())
        .fallback(not_found)
        .with_state(App { state, cancel })
}

pub(crate) fn status(code: u16, reason: &str, message: String) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    });
    (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        axum::Json(body),
    )
        .into_response()
}

fn store_err(e: StoreError) -> Response {
    status(e.code(), e.reason(), e.to_string())
}

async fn not_found(uri: axum::http::Uri) -> Response {
    status(
        404,
        "NotFound",
        format!("the API server emulator does not serve {uri}"),
    )
}

async fn version() -> Response {
    axum::Json(json!({"major": "1", "minor": "34", "gitVersion": "v1.34.0-vcuda-emulator", "platform": "linux/amd64"}))
        .into_response()
}

/// A parsed `fieldSelector` or `labelSelector`: (path or key, op, value).
#[derive(Default, Clone)]
struct Selector {
    fields: Vec<(Vec<String>, bool, String)>,
    labels: Vec<(String, Option<bool>, String)>,
    namespace: Option<String>,
}

/// The non-empty, trimmed comma-separated terms of query parameter `key`.
fn terms<'a>(q: &'a HashMap<String, String>, key: &str) -> impl Iterator<Item = &'a str> {
    q.get(key)
        .map(String::as_str)
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

impl Selector {
    #[allow(clippy::result_large_err)] // the error is the HTTP answer
    fn parse(ns: Option<String>, q: &HashMap<String, String>) -> Result<Selector, Response> {
        let mut sel = Selector {
            namespace: ns,
            ..Default::default()
        };
        for term in terms(q, "fieldSelector") {
            let (k, eq, v) = if let Some((k, v)) = term.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = term.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = term.split_once('=') {
                (k, true, v)
            } else {
                return Err(status(
                    400,
                    "BadRequest",
                    format!("invalid field selector term {term:?}"),
                ));
            };
            sel.fields.push((
                k.split('.').map(str::to_string).collect(),
                eq,
                v.to_string(),
            ));
        }
        for term in terms(q, "labelSelector") {
            if let Some((k, v)) = term.split_once("!=") {
                sel.labels.push((k.into(), Some(false), v.into()));
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                sel.labels.push((k.into(), Some(true), v.into()));
            } else {
                sel.labels.push((term.into(), None, String::new()));
            }
        }
        Ok(sel)
    }

    fn matches(&self, obj: &Value) -> bool {
        if let Some(ns) = &self.namespace
            && obj.pointer("/metadata/namespace").and_then(Value::as_str) != Some(ns)
        {
            return false;
        }
        for (path, eq, want) in &self.fields {
            let mut v = obj;
            for p in path {
                v = v.get(p).unwrap_or(&Value::Null);
            }
            let got = match v {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            };
            if (got == *want) != *eq {
                return false;
            }
        }
        let labels = obj.pointer("/metadata/labels");
        for (k, op, want) in &self.labels {
            let got = labels.and_then(|l| l.get(k)).and_then(Value::as_str);
            let ok = match op {
                None => got.is_some(),
                Some(true) => got == Some(want.as_str()),
                Some(false) => got != Some(want.as_str()),
            };
            if !ok {
                return false;
            }
        }
        true
    }

    /// What a watch with this selector reports for `ev`, if anything.
    fn translate(&self, ev: &Event) -> Option<&'static str> {
        let now = self.matches(&ev.object);
        match ev.typ {
            "MODIFIED" => {
                let before = ev.previous.as_ref().is_some_and(|p| self.matches(p));
                match (before, now) {
                    (true, true) => Some("MODIFIED"),
                    (false, true) => Some("ADDED"),
                    (true, false) => Some("DELETED"),
                    (false, false) => None,
                }
            }
            t => now.then_some(t),
        }
    }
}

fn is_watch(q: &HashMap<String, String>) -> bool {
    matches!(q.get("watch").map(String::as_str), Some("true" | "1"))
}

pub(crate) async fn list_or_watch(
    app: App,
    kind: Kind,
    ns: Option<String>,
    q: HashMap<String, String>,
) -> Response {
    let sel = match Selector::parse(ns, &q) {
        Ok(s) => s,
        Err(r) => return r,
    };
    if is_watch(&q) {
        let since = q
            .get("resourceVersion")
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0);
        let timeout = q
            .get("timeoutSeconds")
            .and_then(|s| s.parse::<u64>().ok())
            .map(Duration::from_secs)
            .unwrap_or(Duration::from_secs(1800));
        return watch(app, kind, sel, since, timeout);
    }
    let (items, rv) = app.state.list_with_rv(kind);
    let items: Vec<Value> = items.into_iter().filter(|o| sel.matches(o)).collect();
    axum::Json(json!({
        "kind": format!("{}List", kind.kind()),
        "apiVersion": kind.api_version(),
        "metadata": {"resourceVersion": rv.to_string()},
        "items": items,
    }))
    .into_response()
}

fn line(typ: &str, obj: &Value) -> Bytes {
    let mut v = serde_json::to_vec(&json!({"type": typ, "object": obj})).unwrap_or_default();
    v.push(b'\n');
    Bytes::from(v)
}

fn watch(app: App, kind: Kind, sel: Selector, since: u64, timeout: Duration) -> Response {
    let (backlog, mut rx) = app.state.watch_from(kind, since);
    let (tx, out) = mpsc::channel::<Result<Bytes, Infallible>>(64);
    tokio::spawn(async move {
        let mut last = since;
        for ev in backlog {
            last = last.max(ev.rv);
            if let Some(t) = sel.translate(&ev)
                && tx.send(Ok(line(t, &ev.object))).await.is_err()
            {
                return;
            }
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = app.cancel.cancelled() => return,
                _ = &mut deadline => return,
                _ = tx.closed() => return,
                r = rx.recv() => match r {
                    Ok(ev) => {
                        if ev.kind != kind || ev.rv <= last {
                            continue;
                        }
                        last = ev.rv;
                        if let Some(t) = sel.translate(&ev)
                            && tx.send(Ok(line(t, &ev.object))).await.is_err()
                        {
                            return;
                        }
                    }
                    // A slow watcher ends its watch; the client re-watches
                    // from its last resourceVersion and the log replays.
                    Err(broadcast::error::RecvError::Lagged(_)) | Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(ReceiverStream::new(out)))
        .unwrap()
}

#[allow(clippy::result_large_err)] // the error is the HTTP answer
pub(crate) fn parse_patch(headers: &HeaderMap, body: &Bytes) -> Result<Value, Response> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let ct = ct.split(';').next().unwrap_or("").trim();
    // For the maps this emulator is used on (annotations, labels) a strategic
    // merge patch is a merge patch.
    if ct != "application/merge-patch+json" && ct != "application/strategic-merge-patch+json" {
        return Err(status(
            415,
            "UnsupportedMediaType",
            format!(
                "patch content type {ct:?} is not supported by the emulator (use merge or strategic merge)"
            ),
        ));
    }
    serde_json::from_slice(body)
        .map_err(|e| status(400, "BadRequest", format!("patch body is not JSON: {e}")))
}

async fn list_all_pods(
    State(app): State<App>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch(app, Kind::Pod, None, q).await
}

async fn list_ns_pods(
    State(app): State<App>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch(app, Kind::Pod, Some(ns), q).await
}

async fn list_nodes(State(app): State<App>, Query(q): Query<HashMap<String, String>>) -> Response {
    list_or_watch(app, Kind::Node, None, q).await
}

async fn list_all_events(
    State(app): State<App>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch(app, Kind::Event, None, q).await
}

async fn list_ns_events(
    State(app): State<App>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch(app, Kind::Event, Some(ns), q).await
}

/// events.k8s.io/v1 create, with the API server's own checks of what an
/// Event must carry (a client that omits them gets 422, as for real).
async fn create_event(State(app): State<App>, Path(ns): Path<String>, body: Bytes) -> Response {
    let v = match serde_json::from_slice::<Value>(&body) {
        Ok(v) => v,
        Err(e) => return status(400, "BadRequest", format!("body is not JSON: {e}")),
    };
    for field in [
        "/eventTime",
        "/reportingController",
        "/reportingInstance",
        "/action",
        "/reason",
        "/type",
    ] {
        if v.pointer(field).is_none_or(Value::is_null) {
            return status(
                422,
                "Invalid",
                format!(
                    "Event.events.k8s.io is invalid: {}: Required value",
                    &field[1..]
                ),
            );
        }
    }
    created(app.state.create(Kind::Event, Some(&ns), v))
}

pub(crate) fn created(r: Result<Value, StoreError>) -> Response {
    match r {
        Ok(v) => (StatusCode::CREATED, axum::Json(v)).into_response(),
        Err(e) => store_err(e),
    }
}

pub(crate) fn ok(r: Result<Value, StoreError>) -> Response {
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => store_err(e),
    }
}

async fn create_pod(State(app): State<App>, Path(ns): Path<String>, body: Bytes) -> Response {
    match serde_json::from_slice::<Value>(&body) {
        Ok(v) => created(app.state.create(Kind::Pod, Some(&ns), v)),
        Err(e) => status(400, "BadRequest", format!("body is not JSON: {e}")),
    }
}

async fn create_node(State(app): State<App>, body: Bytes) -> Response {
    match serde_json::from_slice::<Value>(&body) {
        Ok(v) => created(app.state.create(Kind::Node, None, v)),
        Err(e) => status(400, "BadRequest", format!("body is not JSON: {e}")),
    }
}

pub(crate) fn missing(kind: Kind, name: &str) -> Response {
    store_err(StoreError::NotFound {
        kind: kind.kind(),
        name: name.to_string(),
    })
}

async fn get_pod(State(app): State<App>, Path((ns, name)): Path<(String, String)>) -> Response {
    match app.state.get(Kind::Pod, Some(&ns), &name) {
        Some(v) => axum::Json(v).into_response(),
        None => missing(Kind::Pod, &name),
    }
}

async fn get_node(State(app): State<App>, Path(name): Path<String>) -> Response {
    match app.state.get(Kind::Node, None, &name) {
        Some(v) => axum::Json(v).into_response(),
        None => missing(Kind::Node, &name),
    }
}

async fn patch_pod(
    State(app): State<App>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match parse_patch(&headers, &body) {
        Ok(p) => ok(app.state.patch(Kind::Pod, Some(&ns), &name, &p)),
        Err(r) => r,
    }
}

async fn patch_node(
    State(app): State<App>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match parse_patch(&headers, &body) {
        Ok(p) => ok(app.state.patch(Kind::Node, None, &name, &p)),
        Err(r) => r,
    }
}

async fn delete_pod(State(app): State<App>, Path((ns, name)): Path<(String, String)>) -> Response {
    ok(app.state.delete(Kind::Pod, Some(&ns), &name))
}
