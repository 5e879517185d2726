//! Why the manager refuses a kubelet call, in its own terms. The decisions
//! never speak the wire: the plugin edge (`crate::edge::plugin`) renders a
//! [`Refusal`] as a gRPC status, and the same message goes on the pod's
//! Event, since kubelet shows only a generic admission error.

/// What kind of refusal, which decides whether kubelet's retry can help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// The pod or the request is wrong: a retry cannot help.
    InvalidArgument,
    /// The node has not the capacity asked for.
    ResourceExhausted,
    /// The node disagrees with the request (no such pod, a guess proven
    /// wrong, a GPU the scheduler chose that is not here).
    FailedPrecondition,
    /// Not now: the manager is starting, handing over or cannot reach the
    /// API server; kubelet retries.
    Unavailable,
    /// Something of the manager's own failed (a disk write).
    Internal,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    kind: RefusalKind,
    message: String,
}

impl Refusal {
    pub fn new(kind: RefusalKind, message: impl Into<String>) -> Refusal {
        Refusal {
            kind,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Refusal {
        Refusal::new(RefusalKind::InvalidArgument, message)
    }

    pub fn exhausted(message: impl Into<String>) -> Refusal {
        Refusal::new(RefusalKind::ResourceExhausted, message)
    }

    pub fn precondition(message: impl Into<String>) -> Refusal {
        Refusal::new(RefusalKind::FailedPrecondition, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Refusal {
        Refusal::new(RefusalKind::Unavailable, message)
    }

    pub fn internal(message: impl Into<String>) -> Refusal {
        Refusal::new(RefusalKind::Internal, message)
    }

    pub fn kind(&self) -> RefusalKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same refusal with `ctx` (the pod and container) in front.
    pub fn context(self, ctx: &str) -> Refusal {
        Refusal {
            kind: self.kind,
            message: format!("{ctx}: {}", self.message),
        }
    }
}
