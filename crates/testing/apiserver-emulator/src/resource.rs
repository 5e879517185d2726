//! resource.k8s.io/v1 (Dynamic Resource Allocation): ResourceSlices and
//! DeviceClasses (cluster-scoped), ResourceClaims (namespaced, with a
//! status subresource), each with list, watch, get, create, update (PUT),
//! merge patch and delete. Objects are kept as JSON like the others, so
//! fields newer than the client's types (consumable capacity) survive.

use std::collections::HashMap;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::{get, put};
use serde_json::Value;

use crate::http::{App, created, list_or_watch, ok, parse_patch, status};
use crate::store::Kind;

const BASE: &str = "/apis/resource.k8s.io/v1";

#[allow(clippy::result_large_err)] // the error is the HTTP answer
fn json_body(body: &Bytes) -> Result<Value, Response> {
    serde_json::from_slice(body)
        .map_err(|e| status(400, "BadRequest", format!("body is not JSON: {e}")))
}

/// Routes of one cluster-scoped kind.
fn cluster(kind: Kind) -> Router<App> {
    let list = format!("{BASE}/{}", kind.plural());
    let one = format!("{list}/{{name}}");
    Router::new()
        .route(
            &list,
            get(
                move |State(app): State<App>, Query(q): Query<HashMap<String, String>>| {
                    list_or_watch(app, kind, None, q)
                },
            )
            .post(move |State(app): State<App>, body: Bytes| async move {
                match json_body(&body) {
                    Ok(v) => created(app.state.create(kind, None, v)),
                    Err(r) => r,
                }
            }),
        )
        .route(
            &one,
            get(
                move |State(app): State<App>, Path(name): Path<String>| async move {
                    object(&app, kind, None, &name)
                },
            )
            .put(
                move |State(app): State<App>, Path(name): Path<String>, body: Bytes| async move {
                    match json_body(&body) {
                        Ok(v) => ok(app.state.replace(kind, None, &name, v, false)),
                        Err(r) => r,
                    }
                },
            )
            .patch(
                move |State(app): State<App>,
                      Path(name): Path<String>,
                      headers: HeaderMap,
                      body: Bytes| async move {
                    match parse_patch(&headers, &body) {
                        Ok(p) => ok(app.state.patch(kind, None, &name, &p)),
                        Err(r) => r,
                    }
                },
            )
            .delete(
                move |State(app): State<App>, Path(name): Path<String>| async move {
                    ok(app.state.delete(kind, None, &name))
                },
            ),
        )
}

fn object(app: &App, kind: Kind, ns: Option<&str>, name: &str) -> Response {
    match app.state.get(kind, ns, name) {
        Some(v) => axum::response::IntoResponse::into_response(axum::Json(v)),
        None => crate::http::missing(kind, name),
    }
}

async fn put_claim(app: App, ns: String, name: String, body: Bytes, status_only: bool) -> Response {
    match json_body(&body) {
        Ok(v) => ok(app
            .state
            .replace(Kind::ResourceClaim, Some(&ns), &name, v, status_only)),
        Err(r) => r,
    }
}

async fn patch_claim(
    app: App,
    ns: String,
    name: String,
    headers: HeaderMap,
    body: Bytes,
    status_only: bool,
) -> Response {
    let mut p = match parse_patch(&headers, &body) {
        Ok(p) => p,
        Err(r) => return r,
    };
    // Through /status only the status changes; through the main resource
    // everything but the status.
    if let Some(o) = p.as_object_mut() {
        if status_only {
            o.retain(|k, _| k == "status" || k == "metadata");
        } else {
            o.remove("status");
        }
    }
    ok(app.state.patch(Kind::ResourceClaim, Some(&ns), &name, &p))
}

/// Routes of ResourceClaims.
fn claims() -> Router<App> {
    let k = Kind::ResourceClaim;
    let ns_list = format!("{BASE}/namespaces/{{ns}}/resourceclaims");
    let one = format!("{ns_list}/{{name}}");
    Router::new()
        .route(
            &format!("{BASE}/resourceclaims"),
            get(
                |State(app): State<App>, Query(q): Query<HashMap<String, String>>| {
                    list_or_watch(app, Kind::ResourceClaim, None, q)
                },
            ),
        )
        .route(
            &ns_list,
            get(
                |State(app): State<App>,
                 Path(ns): Path<String>,
                 Query(q): Query<HashMap<String, String>>| {
                    list_or_watch(app, Kind::ResourceClaim, Some(ns), q)
                },
            )
            .post(
                |State(app): State<App>, Path(ns): Path<String>, body: Bytes| async move {
                    match json_body(&body) {
                        Ok(v) => created(app.state.create(Kind::ResourceClaim, Some(&ns), v)),
                        Err(r) => r,
                    }
                },
            ),
        )
        .route(
            &one,
            get(
                move |State(app): State<App>, Path((ns, name)): Path<(String, String)>| async move {
                    object(&app, k, Some(&ns), &name)
                },
            )
            .put(
                |State(app): State<App>, Path((ns, name)): Path<(String, String)>, body: Bytes| {
                    put_claim(app, ns, name, body, false)
                },
            )
            .patch(
                |State(app): State<App>,
                 Path((ns, name)): Path<(String, String)>,
                 headers: HeaderMap,
                 body: Bytes| patch_claim(app, ns, name, headers, body, false),
            )
            .delete(
                move |State(app): State<App>, Path((ns, name)): Path<(String, String)>| async move {
                    ok(app.state.delete(k, Some(&ns), &name))
                },
            ),
        )
        .route(
            &format!("{one}/status"),
            put(
                |State(app): State<App>, Path((ns, name)): Path<(String, String)>, body: Bytes| {
                    put_claim(app, ns, name, body, true)
                },
            )
            .patch(
                |State(app): State<App>,
                 Path((ns, name)): Path<(String, String)>,
                 headers: HeaderMap,
                 body: Bytes| patch_claim(app, ns, name, headers, body, true),
            ),
        )
}

pub(crate) fn routes() -> Router<App> {
    Router::new()
        .merge(cluster(Kind::ResourceSlice))
        .merge(cluster(Kind::DeviceClass))
        .merge(claims())
}
