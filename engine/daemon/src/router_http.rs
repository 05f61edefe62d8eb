//! `--router-listen HOST:PORT`: the router entry (docs/router-entry.md). A router POSTs a
//! signed hints envelope to `/v1/act`; the daemon authenticates it (`RouterGate`) and runs
//! its actions on the namespaces of the named model, before any engine sees the request.
//!
//! - `POST /v1/act`: 200 and a JSON `RouterReply`; 401 when the signature, key id or
//!   timestamp is refused or the request is a replay; 400 for a bad body or envelope; 404
//!   when no namespace of the model is registered; 413 for a body over 1 MiB; 503 when too
//!   many requests arrived within the replay window. Refusals are JSON `{"error": ...}`.
//!   Any other path 404, any other method 405.
//! - Fail-closed: the daemon does not start the entry without a cluster key and events
//!   (config check), and a request is read for its content only after its signature passed.
//! - Bounds: [`crate::http`], with at most 64 connections at once (each may hold a 1 MiB
//!   body while it is checked).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use kvnode_engine::Engine;
use kvnode_engine::api::{RouterGate, RouterRefused, Signed};
use kvnode_proto::router::{
    ACT_PATH, HEADER_KEY_ID, HEADER_SIGNATURE, HEADER_TIMESTAMP, MAX_BODY, RouterRefusal,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::http::{self, Reply, text};

const LIMITS: http::Limits = http::Limits {
    head_timeout: Duration::from_secs(1),
    conn_timeout: Duration::from_secs(10),
    max_conns: 64,
};

/// Binds `addr` and serves the router entry until `stop`; await the handle after stop.
pub async fn spawn(
    engine: &Arc<Engine>,
    addr: &str,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<JoinHandle<()>> {
    let gate = RouterGate::new(engine);
    let handler = move |req: Request<Incoming>| {
        let gate = Arc::clone(&gate);
        async move { answer(&gate, req).await }
    };
    let what = http::Named {
        name: "router entry",
        serves: "the router entry at POST /v1/act",
        flag: "--router-listen",
    };
    http::spawn(what, addr, handler, LIMITS, stop).await
}

fn json(status: StatusCode, body: Vec<u8>) -> Reply {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn refusal(status: StatusCode, error: String) -> Reply {
    let body = serde_json::to_vec(&RouterRefusal { error }).unwrap_or_default();
    json(status, body)
}

fn status_of(e: &RouterRefused) -> StatusCode {
    match e {
        RouterRefused::Invalid(_) => StatusCode::BAD_REQUEST,
        RouterRefused::NoNamespace(_) => StatusCode::NOT_FOUND,
        RouterRefused::Busy => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::UNAUTHORIZED,
    }
}

/// The response to one request.
async fn answer(gate: &RouterGate, req: Request<Incoming>) -> Reply {
    if req.method() != Method::POST {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "POST only\n");
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("POST"));
        return r;
    }
    if req.uri().path() != ACT_PATH {
        return text(
            StatusCode::NOT_FOUND,
            "not found: the router entry is POST /v1/act\n",
        );
    }
    let (head, body) = req.into_parts();
    let header = |name| {
        head.headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };
    let signed = Signed {
        key_id: header(HEADER_KEY_ID),
        timestamp: header(HEADER_TIMESTAMP),
        signature: header(HEADER_SIGNATURE),
    };
    let body = match Limited::new(body, MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return refusal(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body over {MAX_BODY} bytes"),
            );
        }
        Err(e) => return refusal(StatusCode::BAD_REQUEST, format!("reading the body: {e}")),
    };
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    match gate.handle(signed, ACT_PATH, &body, now_ms).await {
        Ok(reply) => match serde_json::to_vec(&reply) {
            Ok(b) => json(StatusCode::OK, b),
            Err(e) => refusal(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("encoding the reply: {e}"),
            ),
        },
        Err(e) => {
            tracing::debug!(error = %e, "router entry request refused");
            refusal(status_of(&e), e.to_string())
        }
    }
}
