//! The `admission.k8s.io/v1` AdmissionReview as the API server sends and
//! reads it: only the fields this webhook uses. A reply keeps the
//! request's `apiVersion` and `uid`; a patch is a base64 JSON Patch.

use base64::Engine;
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Review {
    pub api_version: String,
    pub request: Option<Request>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Request {
    pub uid: String,
    #[serde(default)]
    pub namespace: String,
    pub operation: String,
    #[serde(default)]
    pub object: Option<Value>,
    #[serde(default)]
    pub old_object: Option<Value>,
    #[serde(default)]
    pub dry_run: bool,
    #[serde(default)]
    pub user_info: UserInfo,
}

#[derive(Debug, Default, Deserialize)]
pub struct UserInfo {
    #[serde(default)]
    pub username: String,
    #[serde(default)]
    pub groups: Vec<String>,
}

/// What the webhook answers.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Allow,
    /// Allowed with these JSON Patch operations applied.
    Patch(Vec<Value>),
    /// Refused: the message the user sees after `admission webhook ... denied the request:`.
    Deny(String),
}

/// The AdmissionReview reply to `review` (`uid` of its request).
pub fn reply(api_version: &str, uid: &str, verdict: &Verdict) -> Value {
    let response = match verdict {
        Verdict::Allow => json!({"uid": uid, "allowed": true}),
        Verdict::Patch(ops) => json!({
            "uid": uid,
            "allowed": true,
            "patchType": "JSONPatch",
            "patch": base64::engine::general_purpose::STANDARD
                .encode(serde_json::to_vec(ops).unwrap_or_default()),
        }),
        Verdict::Deny(message) => json!({
            "uid": uid,
            "allowed": false,
            // 403 without a reason: the API server shows `admission webhook
            // "…" denied the request: <message>`; with reason Invalid,
            // kubectl prints only "The request is invalid".
            "status": {"code": 403, "message": message},
        }),
    };
    json!({"apiVersion": api_version, "kind": "AdmissionReview", "response": response})
}

/// A JSON Pointer token: `~` and `/` escaped (`tencent.com~1vcuda-core`).
pub fn pointer_token(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}
