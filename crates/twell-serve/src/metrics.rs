//! The server's counters, written out in Prometheus' text format at `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sparse_llama::Llama;

/// Upper bounds (seconds) of the time-to-first-token histogram's buckets.
const TTFT_BUCKETS: [f64; 10] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

#[derive(Default)]
struct Histogram {
    counts: [u64; TTFT_BUCKETS.len()],
    sum: f64,
    count: u64,
}

#[derive(Default)]
struct FfnCounts {
    nonzeros: u64,
    activations: u64,
}

/// Steps whose FFN counts the engine holds before adding them to the metrics.
const FFN_FLUSH_STEPS: usize = 64;

/// Per-layer FFN counts as the engine collects them: left where the MLPs put them (on
/// the device, on CUDA) and added to the metrics every [`FFN_FLUSH_STEPS`] steps or when
/// the engine idles, not read back (a synchronisation per layer) every step.
#[derive(Default)]
pub struct FfnTally {
    /// Per layer: the counts of the steps since the last flush, and the activations
    /// they were counted over.
    layers: Vec<(Vec<twell::Nonzeros>, u64)>,
    steps: usize,
}

impl FfnTally {
    /// Takes each layer's counts of the model's last forward pass, where it records
    /// them (a ReLU model).
    pub fn record(&mut self, model: &Llama) -> candle_core::Result<()> {
        for (i, mlp) in model.mlps().enumerate() {
            if let Some((count, entries)) = mlp.last_nonzeros()? {
                if self.layers.len() <= i {
                    self.layers.resize_with(i + 1, Default::default);
                }
                self.layers[i].0.push(count);
                self.layers[i].1 += entries as u64;
            }
        }
        self.steps += 1;
        Ok(())
    }

    pub fn due(&self) -> bool {
        self.steps >= FFN_FLUSH_STEPS
    }

    /// Adds what it holds to `metrics`.
    pub fn flush(&mut self, metrics: &Metrics) -> candle_core::Result<()> {
        for (layer, (counts, activations)) in self.layers.iter_mut().enumerate() {
            if counts.is_empty() {
                continue;
            }
            metrics.add_ffn(layer, twell::Nonzeros::sum(counts)?, *activations);
            counts.clear();
            *activations = 0;
        }
        self.steps = 0;
        Ok(())
    }
}

/// What the engine's thread spends its time on, a step at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Prompt chunks through the model (and their first tokens).
    Prefill,
    /// The batched decode step, up to its logits on the host.
    Decode,
    /// Sampling the decoded rows.
    Sample,
    /// Appending tokens, detokenizing and sending text to the clients.
    Emit,
}

impl Phase {
    const ALL: [Phase; 4] = [Phase::Prefill, Phase::Decode, Phase::Sample, Phase::Emit];

    fn as_str(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
            Phase::Sample => "sample",
            Phase::Emit => "emit",
        }
    }
}

/// Every figure `GET /metrics` reports.
pub struct Metrics {
    started: Instant,
    /// Responses by endpoint and HTTP status.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    cancelled: AtomicU64,
    failed: AtomicU64,
    queued: AtomicUsize,
    running: AtomicUsize,
    ttft: Mutex<Histogram>,
    /// Per layer: the FFN's nonzero activations and the activations counted.
    ffn: Mutex<Vec<FfnCounts>>,
    /// Nanoseconds the engine spent in each [`Phase`].
    phase_nanos: [AtomicU64; 4],
    prefix_hits: AtomicU64,
    prefix_tokens: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            requests: Mutex::default(),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            queued: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            ttft: Mutex::default(),
            ffn: Mutex::default(),
            phase_nanos: Default::default(),
            prefix_hits: AtomicU64::new(0),
            prefix_tokens: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    pub fn request(&self, endpoint: &str, status: u16) {
        let mut r = self.requests.lock().expect("metrics lock");
        *r.entry((endpoint.to_string(), status)).or_default() += 1;
    }

    pub fn queue_entered(&self) {
        self.queued.fetch_add(1, Ordering::Relaxed);
    }

    pub fn queue_left(&self) {
        self.queued.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn set_running(&self, n: usize) {
        self.running.store(n, Ordering::Relaxed);
    }

    pub fn add_prompt(&self, n: usize) {
        self.prompt_tokens.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn add_generated(&self, n: usize) {
        self.generated_tokens.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn cancelled(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
    }

    pub fn failed(&self) {
        self.failed.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_first_token(&self, wait: Duration) {
        let secs = wait.as_secs_f64();
        let mut h = self.ttft.lock().expect("metrics lock");
        for (bound, count) in TTFT_BUCKETS.iter().zip(h.counts.iter_mut()) {
            if secs <= *bound {
                *count += 1;
            }
        }
        h.sum += secs;
        h.count += 1;
    }

    /// Adds counts to layer `layer`'s FFN density.
    pub fn add_ffn(&self, layer: usize, nonzeros: u64, activations: u64) {
        let mut ffn = self.ffn.lock().expect("metrics lock");
        if ffn.len() <= layer {
            ffn.resize_with(layer + 1, FfnCounts::default);
        }
        ffn[layer].nonzeros += nonzeros;
        ffn[layer].activations += activations;
    }

    /// A request started from a cached prompt prefix of `tokens` tokens.
    pub fn prefix_hit(&self, tokens: usize) {
        self.prefix_hits.fetch_add(1, Ordering::Relaxed);
        self.prefix_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// Adds `spent` to the engine's time in `phase`.
    pub fn add_phase(&self, phase: Phase, spent: Duration) {
        let nanos = u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX);
        self.phase_nanos[phase as usize].fetch_add(nanos, Ordering::Relaxed);
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// The text format of Prometheus.
    pub fn render(&self, model_id: &str) -> String {
        let mut s = String::new();
        let counter = |s: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |s: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let _ = writeln!(
            s,
            "# HELP twell_requests_total HTTP responses by endpoint and status.\n# TYPE twell_requests_total counter"
        );
        for ((endpoint, status), n) in self.requests.lock().expect("metrics lock").iter() {
            let _ = writeln!(
                s,
                "twell_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
            );
        }
        let generated = self.generated_tokens.load(Ordering::Relaxed);
        counter(
            &mut s,
            "twell_prompt_tokens_total",
            "Prompt tokens of finished requests.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut s,
            "twell_generated_tokens_total",
            "Tokens generated.",
            generated,
        );
        counter(
            &mut s,
            "twell_requests_cancelled_total",
            "Requests whose client went away before they finished.",
            self.cancelled.load(Ordering::Relaxed),
        );
        counter(
            &mut s,
            "twell_requests_failed_total",
            "Requests the engine could not run.",
            self.failed.load(Ordering::Relaxed),
        );
        counter(
            &mut s,
            "twell_prefix_cache_hits_total",
            "Requests that started from a cached prompt prefix.",
            self.prefix_hits.load(Ordering::Relaxed),
        );
        counter(
            &mut s,
            "twell_prefix_cache_tokens_total",
            "Prompt tokens taken from the prefix cache instead of prefilled.",
            self.prefix_tokens.load(Ordering::Relaxed),
        );
        gauge(
            &mut s,
            "twell_queue_depth",
            "Requests waiting for a slot.",
            self.queued() as f64,
        );
        gauge(
            &mut s,
            "twell_running_sequences",
            "Sequences in flight.",
            self.running.load(Ordering::Relaxed) as f64,
        );
        let uptime = self.started.elapsed().as_secs_f64();
        gauge(
            &mut s,
            "twell_generated_tokens_per_second",
            "Tokens generated per second since the server started.",
            if uptime > 0.0 {
                generated as f64 / uptime
            } else {
                0.0
            },
        );
        {
            let h = self.ttft.lock().expect("metrics lock");
            let name = "twell_time_to_first_token_seconds";
            let _ = writeln!(
                s,
                "# HELP {name} From a request's arrival to its first token.\n# TYPE {name} histogram"
            );
            for (bound, count) in TTFT_BUCKETS.iter().zip(h.counts) {
                let _ = writeln!(s, "{name}_bucket{{le=\"{bound}\"}} {count}");
            }
            let _ = writeln!(s, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(s, "{name}_sum {}\n{name}_count {}", h.sum, h.count);
        }
        {
            let name = "twell_engine_seconds_total";
            let _ = writeln!(
                s,
                "# HELP {name} Time the engine spent, by phase of its steps.\n# TYPE {name} counter"
            );
            for phase in Phase::ALL {
                let secs = self.phase_nanos[phase as usize].load(Ordering::Relaxed) as f64 * 1e-9;
                let _ = writeln!(s, "{name}{{phase=\"{}\"}} {secs}", phase.as_str());
            }
        }
        let ffn = self.ffn.lock().expect("metrics lock");
        if !ffn.is_empty() {
            let name = "twell_ffn_density";
            let _ = writeln!(
                s,
                "# HELP {name} Fraction of FFN activations that are nonzero, per layer, over every token run.\n# TYPE {name} gauge"
            );
            for (layer, c) in ffn.iter().enumerate() {
                let density = if c.activations > 0 {
                    c.nonzeros as f64 / c.activations as f64
                } else {
                    0.0
                };
                let _ = writeln!(
                    s,
                    "{name}{{model=\"{model_id}\",layer=\"{layer}\"}} {density}"
                );
            }
        }
        s
    }
}
