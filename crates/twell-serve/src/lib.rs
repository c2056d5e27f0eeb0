//! `twell serve`: an OpenAI-compatible HTTP server over a SparseLlama model.
//!
//! - `POST /v1/chat/completions` (the model's chat template) and `POST /v1/completions`,
//!   whole or streamed as server-sent events ending in `data: [DONE]`;
//! - `GET /v1/models`, `GET /health`, and `GET /metrics` (Prometheus text);
//! - continuous batching ([`engine`]): requests join the sequences in flight between
//!   steps, prompts are prefilled in chunks, at most `max_sequences` run at once and a
//!   bounded queue answers 429 when full; a client that goes away frees its slot;
//! - shutdown on SIGINT or SIGTERM stops accepting and finishes what is in flight.

pub mod api;
pub mod app;
pub mod engine;
pub mod metrics;
pub mod sample;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use sparse_llama::tokenizer::ChatFormat;
use tokio::sync::mpsc;

pub use engine::{EngineConfig, EngineModel};
pub use metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("invalid server options: {0}")]
    Options(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// Where and how the server runs.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    /// Sequences in flight at once.
    pub max_sequences: usize,
    /// Requests that may wait for a slot; more are answered 429.
    pub queue: usize,
    /// Prompt tokens a sequence prefills per engine step.
    pub prefill_chunk: usize,
    /// Prompt prefixes kept prefilled for the requests that start with them; 0 is none.
    pub prefix_cache: usize,
    pub max_body_bytes: usize,
    /// On CUDA, replay each decode step as a CUDA graph (off: the decode engine's
    /// steps launch their ops one by one).
    pub graphs: bool,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            max_sequences: 16,
            queue: 64,
            prefill_chunk: 128,
            prefix_cache: 8,
            max_body_bytes: 1 << 20,
            graphs: true,
        }
    }
}

/// What the server serves.
pub struct Served {
    pub model: EngineModel,
    /// The id the model answers to, besides `default`.
    pub model_id: String,
    pub chat: Option<ChatFormat>,
}

/// Serves until SIGINT or SIGTERM, then finishes the requests in flight. The engine
/// runs on the calling thread (the model's compute stays on it and the thread pool it
/// uses); the HTTP side on a small tokio runtime. `on_listening` gets the bound
/// address once the socket is open.
pub fn serve(
    served: Served,
    opts: &ServeOptions,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<(), ServeError> {
    if opts.max_sequences == 0 || opts.queue == 0 || opts.prefill_chunk == 0 {
        return Err(ServeError::Options(
            "--max-sequences, --queue and --prefill-chunk must be at least 1".into(),
        ));
    }
    let io = |what: &str| {
        let what = what.to_string();
        move |source| ServeError::Io { what, source }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(io("starting the HTTP runtime"))?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind((
            opts.host.as_str(),
            opts.port,
        )))
        .map_err(io(&format!("binding {}:{}", opts.host, opts.port)))?;
    on_listening(
        listener
            .local_addr()
            .map_err(io("reading the bound address"))?,
    );
    let metrics = Arc::new(Metrics::default());
    let (jobs, pending) = mpsc::channel(opts.queue);
    let context = served.model.llama.config().max_position_embeddings;
    let state = Arc::new(app::AppState {
        model_id: served.model_id,
        tokenizer: served.model.tokenizer.clone(),
        chat: served.chat,
        context,
        jobs,
        metrics: metrics.clone(),
        next_id: AtomicU64::new(1),
    });
    let router = app::router(state, opts.max_body_bytes);
    let server = runtime.spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown_signal())
            .await
    });
    let cfg = EngineConfig {
        max_sequences: opts.max_sequences,
        prefill_chunk: opts.prefill_chunk,
        prefix_cache: opts.prefix_cache,
        graphs: opts.graphs,
    };
    // Returns once the router (and with it the queue's sender) is gone: after the
    // graceful shutdown has let every open request finish.
    engine::run(served.model, pending, cfg, metrics);
    runtime
        .block_on(server)
        .map_err(|e| ServeError::Io {
            what: "the HTTP server".into(),
            source: std::io::Error::other(e.to_string()),
        })?
        .map_err(io("the HTTP server"))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
