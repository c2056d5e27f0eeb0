//! The HTTP side: routes, request checks, and the engine's events turned into OpenAI
//! responses (whole, or as server-sent events ending in `data: [DONE]`).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde_json::{json, Value};
use sparse_llama::tokenizer::ChatFormat;
use tokenizers::Tokenizer;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::api::{error_body, ChatRequest, Common, CompletionRequest, Prompt, Usage};
use crate::engine::{Event, Job, SamplingParams};
use crate::metrics::Metrics;

/// What the routes share.
pub struct AppState {
    /// The id the model answers to (besides `default`).
    pub model_id: String,
    pub tokenizer: Tokenizer,
    pub chat: Option<ChatFormat>,
    /// Positions the model takes: prompt and completion together.
    pub context: usize,
    pub jobs: mpsc::Sender<Job>,
    pub metrics: Arc<Metrics>,
    pub next_id: AtomicU64,
}

/// An OpenAI-style error response.
pub struct ApiError {
    status: StatusCode,
    body: Value,
}

impl ApiError {
    fn new(status: StatusCode, kind: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            body: error_body(&message.into(), kind, None, None),
        }
    }

    fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}

/// The routes, with `max_body_bytes` as the body limit.
pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    let metrics = state.metrics.clone();
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let metrics = metrics.clone();
                async move {
                    let path = req.uri().path().to_string();
                    let endpoint = match path.as_str() {
                        "/v1/chat/completions"
                        | "/v1/completions"
                        | "/v1/models"
                        | "/health"
                        | "/metrics" => path,
                        _ => "other".to_string(),
                    };
                    let response = next.run(req).await;
                    metrics.request(&endpoint, response.status().as_u16());
                    response
                }
            },
        ))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "no such route (POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics)",
    )
}

async fn health() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let model =
        |id: &str| json!({ "id": id, "object": "model", "created": 0, "owned_by": "twell" });
    Json(json!({
        "object": "list",
        "data": [model(&state.model_id), model("default")],
    }))
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        state.metrics.render(&state.model_id),
    )
}

/// The body as JSON of type `T`, or a 400/413 in OpenAI's form.
fn parse<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = body.map_err(|e| {
        let status = e.status();
        let kind = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "request_too_large"
        } else {
            "invalid_request_error"
        };
        ApiError::new(status, kind, e.body_text())
    })?;
    serde_json::from_slice(&body).map_err(|e| ApiError::invalid(format!("request body: {e}")))
}

/// A checked request, ready for the engine.
struct Prepared {
    prompt: Vec<u32>,
    params: SamplingParams,
    stream: bool,
    include_usage: bool,
}

impl AppState {
    fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model == self.model_id || model == "default" {
            return Ok(());
        }
        Err(ApiError {
            status: StatusCode::NOT_FOUND,
            body: error_body(
                &format!(
                    "the model {model:?} does not exist: this server serves {:?} (also called \"default\")",
                    self.model_id
                ),
                "invalid_request_error",
                Some("model"),
                Some("model_not_found"),
            ),
        })
    }

    /// Checks a request's fields (its model checked first, by the handler) and
    /// tokenizes its text.
    fn prepare(
        &self,
        text: &str,
        common: Common,
        default_max: Option<u64>,
    ) -> Result<Prepared, ApiError> {
        if common.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid(
                "n: only one choice per request is served",
            ));
        }
        let temperature = common.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(format!(
                "temperature must be in [0, 2], got {temperature}"
            )));
        }
        if let Some(p) = common.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ApiError::invalid(format!(
                    "top_p must be in (0, 1], got {p}"
                )));
            }
        }
        let repeat_penalty = common.repetition_penalty.unwrap_or(1.0);
        if !(repeat_penalty > 0.0 && repeat_penalty.is_finite()) {
            return Err(ApiError::invalid("repetition_penalty must be > 0"));
        }
        let stop = common.stop.map(|s| s.into_vec()).unwrap_or_default();
        if stop.len() > 4 || stop.iter().any(|s| s.is_empty()) {
            return Err(ApiError::invalid("stop: up to 4 non-empty texts"));
        }
        let prompt = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| ApiError::invalid(format!("tokenizing the prompt: {e}")))?
            .get_ids()
            .to_vec();
        if prompt.is_empty() {
            return Err(ApiError::invalid("the prompt encodes to no tokens"));
        }
        if prompt.len() >= self.context {
            return Err(ApiError::invalid(format!(
                "the prompt is {} tokens; this model's context is {}",
                prompt.len(),
                self.context
            )));
        }
        let room = (self.context - prompt.len()) as u64;
        let max_tokens = match common.max_completion_tokens.or(common.max_tokens) {
            Some(0) => return Err(ApiError::invalid("max_tokens must be at least 1")),
            Some(m) if m > room => {
                return Err(ApiError::invalid(format!(
                    "max_tokens ({m}) + the prompt's {} tokens exceed this model's context of {} tokens",
                    prompt.len(),
                    self.context
                )))
            }
            Some(m) => m,
            None => default_max.unwrap_or(room).min(room),
        };
        let include_usage = common.stream_options.is_some_and(|o| o.include_usage);
        Ok(Prepared {
            prompt,
            params: SamplingParams {
                max_tokens: max_tokens as usize,
                temperature,
                top_p: common.top_p,
                seed: common
                    .seed
                    .unwrap_or_else(|| self.next_id.load(Ordering::Relaxed)),
                stop,
                repeat_penalty,
                ignore_eos: common.ignore_eos.unwrap_or(false),
            },
            stream: common.stream.unwrap_or(false),
            include_usage,
        })
    }

    /// Hands a request to the engine; 429 if the queue is full, 503 if the engine has
    /// stopped.
    fn submit(&self, p: &Prepared) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let job = Job {
            prompt: p.prompt.clone(),
            params: p.params.clone(),
            events: tx,
            queued_at: Instant::now(),
        };
        self.metrics.queue_entered();
        match self.jobs.try_send(job) {
            Ok(()) => Ok(rx),
            Err(e) => {
                self.metrics.queue_left();
                Err(match e {
                    mpsc::error::TrySendError::Full(_) => ApiError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        "rate_limit_exceeded",
                        "the server's queue is full: retry later",
                    ),
                    mpsc::error::TrySendError::Closed(_) => ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        "the server is shutting down",
                    ),
                })
            }
        }
    }

    fn new_id(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.next_id.fetch_add(1, Ordering::Relaxed))
    }
}

/// An error's message without the backtrace candle may append to it.
pub fn first_line(e: &impl std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Which endpoint a response is for: they differ in object names and in where the text
/// goes.
#[derive(Clone, Copy)]
enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn choice(self, text: Option<&str>, finish: Option<&str>, first: bool) -> Value {
        match self {
            Self::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({ "index": 0, "delta": delta, "finish_reason": finish })
            }
            Self::Completion => json!({
                "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish,
            }),
        }
    }

    fn chunk_object(self) -> &'static str {
        match self {
            Self::Chat => "chat.completion.chunk",
            Self::Completion => "text_completion",
        }
    }
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse(body)?;
    state.check_model(&req.common.model)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty"));
    }
    let chat = state
        .chat
        .as_ref()
        .ok_or_else(|| ApiError::invalid("this model has no chat template: use /v1/completions"))?;
    let turns = req
        .messages
        .iter()
        .map(|m| {
            Ok((
                m.role.as_str(),
                m.content.text().map_err(ApiError::invalid)?,
            ))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let text = chat
        .conversation(turns.iter().map(|(r, c)| (*r, c.as_str())))
        .map_err(|e| ApiError::invalid(first_line(&e)))?;
    let prepared = state.prepare(&text, req.common, None)?;
    respond(state, prepared, Kind::Chat).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse(body)?;
    state.check_model(&req.common.model)?;
    let text = match req.prompt {
        Prompt::One(t) => t,
        Prompt::Many(mut v) if v.len() == 1 => v.remove(0),
        Prompt::Many(_) => return Err(ApiError::invalid("prompt: one text per request is served")),
    };
    // OpenAI's default for this endpoint.
    let prepared = state.prepare(&text, req.common, Some(16))?;
    respond(state, prepared, Kind::Completion).await
}

async fn respond(
    state: Arc<AppState>,
    prepared: Prepared,
    kind: Kind,
) -> Result<Response, ApiError> {
    let events = state.submit(&prepared)?;
    let id = state.new_id(match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    });
    let model = state.model_id.clone();
    let created = now_secs();
    if prepared.stream {
        return Ok(
            stream(events, id, model, created, kind, prepared.include_usage).into_response(),
        );
    }
    let mut events = events;
    let mut text = String::new();
    while let Some(event) = events.recv().await {
        match event {
            Event::Text(t) => text.push_str(&t),
            Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            } => {
                let usage = Usage::new(prompt_tokens, completion_tokens);
                let choice = match kind {
                    Kind::Chat => json!({
                        "index": 0,
                        "message": { "role": "assistant", "content": text },
                        "finish_reason": finish.as_str(),
                    }),
                    Kind::Completion => json!({
                        "index": 0, "text": text, "logprobs": null, "finish_reason": finish.as_str(),
                    }),
                };
                let object = match kind {
                    Kind::Chat => "chat.completion",
                    Kind::Completion => "text_completion",
                };
                return Ok(Json(json!({
                    "id": id, "object": object, "created": created, "model": model,
                    "choices": [choice], "usage": usage,
                }))
                .into_response());
            }
            Event::Failed(why) => {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    why,
                ))
            }
        }
    }
    Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "the engine stopped before the request finished",
    ))
}

/// The engine's events as server-sent events: a chunk per text piece, one with the
/// finish reason, optionally one with the usage, then `[DONE]`. Dropping the stream
/// (the client went away) closes the channel, and the engine frees the slot.
fn stream(
    events: mpsc::UnboundedReceiver<Event>,
    id: String,
    model: String,
    created: u64,
    kind: Kind,
    include_usage: bool,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let mut first = true;
    let chunk = move |choices: Value, usage: Option<Value>| {
        let mut c = json!({
            "id": id.as_str(), "object": kind.chunk_object(), "created": created,
            "model": model.as_str(), "choices": choices,
        });
        if let Some(u) = usage {
            c["usage"] = u;
        }
        SseEvent::default().data(c.to_string())
    };
    let body = UnboundedReceiverStream::new(events).flat_map(move |event| {
        let out: Vec<SseEvent> = match event {
            Event::Text(t) => {
                let c = chunk(json!([kind.choice(Some(&t), None, first)]), None);
                first = false;
                vec![c]
            }
            Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            } => {
                let mut v = vec![chunk(
                    json!([kind.choice(None, Some(finish.as_str()), first)]),
                    None,
                )];
                if include_usage {
                    let usage = serde_json::to_value(Usage::new(prompt_tokens, completion_tokens))
                        .unwrap_or(Value::Null);
                    v.push(chunk(json!([]), Some(usage)));
                }
                v.push(SseEvent::default().data("[DONE]"));
                v
            }
            Event::Failed(why) => vec![
                SseEvent::default().data(error_body(&why, "server_error", None, None).to_string()),
                SseEvent::default().data("[DONE]"),
            ],
        };
        futures_util::stream::iter(out.into_iter().map(Ok))
    });
    Sse::new(body)
}
