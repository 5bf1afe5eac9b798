//! `nflash serve`: an OpenAI-compatible HTTP server for apps —
//! `POST /v1/chat/completions`, `POST /v1/completions` (both with
//! `stream: true` as server-sent events), `GET /v1/models`, `GET /health`.
//!
//! One model, one generation at a time (a phone has one set of big cores):
//! the generation thread, a worker of the compute pool, owns the model and a
//! [`Session`] (so a chat whose tokens start with the previous request's
//! reuses that KV cache); requests wait in a bounded queue and get 503 with
//! `Retry-After` when it is full. The HTTP side is axum (hyper's HTTP/1) on
//! a one-thread tokio runtime: it checks the API key, parses and bounds the
//! request and turns it into token ids, so a bad request is answered at once
//! even while a generation runs. A client that goes away (its connection
//! closed, so its response is dropped) cancels its generation at the next
//! check: between prefill passes and after every token.
//!
//! Browsers: a page on any web site can make a browser send requests to
//! 127.0.0.1, so every request passes [`guard`] first: a request with an
//! `Origin` not on the `--allowed-origin` list gets 403 (CORS preflights
//! from listed origins are answered), a request body must be
//! `Content-Type: application/json` (415: a cross-site form cannot send
//! that without a preflight), and without an API key the `Host` header
//! must name this machine's loopback address, `localhost` or the bound
//! address (403: DNS rebinding). Message content is tokenized as text
//! ([`ContentTokens::Text`]: typed control tokens stay characters) unless
//! `--special-tokens-in-content`; error messages sent to clients have file
//! paths replaced ([`scrub_paths`]).

use nflash_runtime::model::MemoryControl;
use nflash_runtime::pressure::Watch;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::Args;
use nflash_plan::planner::parse_bytes;
use nflash_runtime::chat::{ChatOptions, ContentTokens, Message, ROLES};
use nflash_runtime::generate::{CancelToken, Finish, GenerateOptions};
use nflash_runtime::sampler::{Sampler, SamplerConfig};
use nflash_runtime::session::{Session, Turn};
use nflash_runtime::{message, Engine, Prompter};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio_stream::StreamExt;

use crate::common::{context_len, in_pool, open_pack, Verify};
use crate::memory::{load_engine, MemoryArgs};
use crate::sampling::{clock_seed, SamplingArgs, SpeculateArgs};
use nflash_runtime::draft::SpecOptions;

/// Arguments of `nflash serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// The .nflash pack (from `prep convert`).
    #[arg(long)]
    model: PathBuf,
    /// Address to listen on. Any address but a loopback one (127.0.0.1,
    /// ::1) needs an API key.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// TCP port; 0 picks a free one (printed at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// API key clients must send as `Authorization: Bearer KEY` (every
    /// endpoint but /health). Other users of the machine can read it in the
    /// process list: prefer --api-key-file.
    #[arg(long, conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// File whose first line is the API key.
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Model name in /v1/models and responses [default: the pack's file
    /// name without .nflash]. Requests may name any model: this server has one.
    #[arg(long)]
    alias: Option<String>,
    /// Requests that may wait while one generates; more get 503 with Retry-After.
    #[arg(long, default_value_t = 8)]
    queue: usize,
    /// Tokens to generate when a request gives no max_tokens [default: 256, at most --max-tokens-limit].
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Largest max_tokens a request may ask for [default: the context length].
    #[arg(long)]
    max_tokens_limit: Option<usize>,
    /// Largest request body (e.g. 1MiB, at least 1KiB); a larger one gets 400.
    #[arg(long, default_value = "1MiB", value_parser = parse_bytes)]
    max_body: u64,
    /// Open connections at most; more wait to be accepted.
    #[arg(long, default_value_t = 64)]
    max_connections: usize,
    /// A web origin (scheme://host[:port], e.g. http://localhost:3000) whose
    /// pages may call this server from a browser (CORS); repeatable. Requests
    /// carrying any other Origin header get 403. None by default: no web
    /// page can use the server through a browser.
    #[arg(long = "allowed-origin", value_name = "ORIGIN")]
    allowed_origins: Vec<String>,
    /// Tokenize special-token text in message content (e.g. `<|im_end|>`) as
    /// the control tokens it spells, as Hugging Face's apply_chat_template
    /// does. Off by default: content is plain text, so a message cannot end
    /// its turn or forge another role's. Only for clients you trust.
    #[arg(long)]
    special_tokens_in_content: bool,
    /// The chat template's `enable_thinking` for requests that do not set
    /// it (`chat_template_kwargs: {"enable_thinking": …}`): `false` makes
    /// Qwen3 and SmolLM3 answer without a `<think>` section; unset leaves
    /// the template's default (thinking).
    #[arg(long, value_name = "true|false")]
    enable_thinking: Option<bool>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Speculative decoding for every request (timings report drafted and accepted tokens).
    #[command(flatten)]
    speculative: SpeculateArgs,
    /// Compute threads (default: the big cores where a phone has big and
    /// little ones, pinned there; else all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Context length in tokens (KV cache size), which bounds a request's
    /// prompt plus reply; default: the pack plan's, else min(4096, model maximum).
    #[arg(long)]
    ctx: Option<usize>,
    /// Checksums to check: lazy = each neuron cluster's CRC-32C after it is
    /// read, before it is used; full = that and every segment's CRC-32 at
    /// start; off = no cluster checks.
    #[arg(long, value_enum, default_value = "lazy", num_args = 0..=1, default_missing_value = "full")]
    verify: Verify,
    #[command(flatten)]
    memory: MemoryArgs,
}

pub fn run(a: ServeArgs) -> Result<()> {
    let key = api_key(&a)?;
    let addr = (a.host.as_str(), a.port)
        .to_socket_addrs()
        .with_context(|| format!("--host {}: not an address or a name that resolves", a.host))?
        .next()
        .with_context(|| format!("--host {} resolves to no address", a.host))?;
    if !addr.ip().is_loopback() && key.is_none() {
        bail!(
            "refusing to listen on {addr} without an API key: anyone who can reach that address could use the model; pass --api-key-file FILE (or --api-key KEY), or listen on 127.0.0.1"
        );
    }
    if !(1024..=(1 << 30)).contains(&a.max_body) {
        bail!("--max-body {} must be between 1KiB and 1GiB; requests are JSON text, a few MiB at most", a.max_body);
    }
    if a.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    for o in &a.allowed_origins {
        if normalize_origin(o).is_none() {
            bail!("--allowed-origin {o:?} is not an origin: give scheme://host[:port] with no path, e.g. http://localhost:3000 (`*` is not accepted)");
        }
    }
    // Bind before loading the model, so a port in use fails at once.
    let listener = TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    in_pool(a.threads, || serve_in_pool(a, key, listener))
}

/// The API key from --api-key or the first line of --api-key-file.
fn api_key(a: &ServeArgs) -> Result<Option<String>> {
    let key = match (&a.api_key, &a.api_key_file) {
        (Some(k), _) => k.clone(),
        (None, Some(f)) => {
            let text =
                std::fs::read_to_string(f).with_context(|| format!("cannot read --api-key-file {}", f.display()))?;
            text.lines().next().unwrap_or("").trim().to_string()
        }
        (None, None) => return Ok(None),
    };
    if key.is_empty() || key.chars().any(|c| c.is_control() || c == ' ') {
        bail!("the API key is empty or holds spaces or control characters; use a printable token such as the output of `openssl rand -hex 16`");
    }
    Ok(Some(key))
}

/// What the HTTP handlers share.
struct Shared {
    model_id: String,
    created: u64,
    key: Option<String>,
    /// --allowed-origin, normalized ([`normalize_origin`]).
    origins: Vec<String>,
    /// The address the server listens on (a Host naming it is accepted).
    bound: SocketAddr,
    /// --host as given (a Host naming it is accepted).
    host_name: String,
    /// How message content is tokenized (--special-tokens-in-content) and
    /// the default `enable_thinking` (--enable-thinking).
    chat_options: ChatOptions,
    prompter: Prompter,
    /// Sampling defaults (flags, else the pack's generation_config.json,
    /// else nflash's); the seed only when --seed was given.
    sampling: SamplerConfig,
    fixed_seed: bool,
    max_tokens: usize,
    max_tokens_limit: usize,
    max_body: usize,
    ctx: usize,
    /// --queue: requests that may wait.
    queue: usize,
    jobs: Arc<Queue>,
    budget: Option<u64>,
    /// The neuron cache's memory (`/admin/memory`) and the governor that
    /// follows the system's memory signals.
    memory: Option<Arc<dyn MemoryControl>>,
    watch: Option<Watch>,
}

/// The requests waiting for the generation thread, and whether it runs one.
#[derive(Default)]
struct Queue {
    state: Mutex<QueueState>,
    /// Signalled when a job arrives or the queue closes.
    ready: Condvar,
    /// Wall time of the last generation, milliseconds (for Retry-After).
    last_ms: AtomicU64,
}

#[derive(Default)]
struct QueueState {
    /// Accepted requests, oldest first, not yet taken (a client that goes
    /// away takes its own out: [`Waiter`]).
    jobs: VecDeque<Job>,
    /// A generation runs.
    busy: bool,
    /// The HTTP side has stopped: the generation thread ends.
    closed: bool,
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `job` if fewer than `max` wait (one more when nothing runs:
    /// the generation thread takes it at once); false (the job dropped) otherwise.
    fn push(&self, job: Job, max: usize) -> bool {
        let mut q = self.lock();
        if q.jobs.len() >= max + usize::from(!q.busy && q.jobs.is_empty()) {
            return false;
        }
        q.jobs.push_back(job);
        self.ready.notify_one();
        true
    }

    /// The next job, marking the generation thread busy; `None` once closed.
    fn take(&self) -> Option<Job> {
        let mut q = self.lock();
        loop {
            if let Some(job) = q.jobs.pop_front() {
                q.busy = true;
                return Some(job);
            }
            if q.closed {
                return None;
            }
            q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }
}

/// Held by the request's handler (or its response stream): when the client
/// goes away before the generation thread takes its job, the job leaves
/// the queue at once.
/// Dropped also when the job runs, it then cancels the generation (at its
/// next check: between prefill passes, after every token).
struct Waiter {
    queue: Arc<Queue>,
    id: u64,
    cancel: CancelToken,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        // After the job ended this is harmless: the token is the job's own.
        self.cancel.cancel();
        let mut q = self.queue.lock();
        if let Some(i) = q.jobs.iter().position(|j| j.id == self.id) {
            q.jobs.remove(i);
        }
    }
}

/// One request for the generation thread.
struct Job {
    /// Also the response's id number.
    id: u64,
    ids: Vec<u32>,
    ignore_eos: bool,
    sampling: SamplerConfig,
    max_tokens: usize,
    stop: Vec<String>,
    events: UnboundedSender<Event>,
    enqueued: Instant,
    /// Raised when the client goes away ([`Waiter`]).
    cancel: CancelToken,
}

/// What the generation thread sends back for a job.
enum Event {
    /// A piece of the reply's text.
    Text(String),
    /// The end: counts, why it stopped, timings.
    Done { prompt_tokens: usize, completion_tokens: usize, finish_reason: &'static str, timings: Value },
    /// Generation failed (the model's error).
    Failed(String),
}

fn serve_in_pool(a: ServeArgs, key: Option<String>, listener: TcpListener) -> Result<()> {
    a.speculative.check()?;
    let device = a.memory.device_profile()?;
    let pack = open_pack(&a.model, a.verify)?;
    let draft = a.speculative.draft.as_deref().map(|p| open_pack(p, a.verify).context("--draft")).transpose()?;
    let ctx = context_len(&pack, a.ctx)?;
    let draft_kind = draft.as_ref().map(|d| (d, a.speculative.speculate_draft));
    let (engine, plan) = load_engine(&pack, draft_kind, &a.memory, device, ctx, a.verify.clusters())?;
    let mut session = Session::new(&engine, ctx)?;
    let (sampling, _) = a.sampling.resolve(&engine.generation);
    let model_id = a.alias.clone().unwrap_or_else(|| {
        a.model.file_stem().map_or_else(|| "nflash".to_string(), |s| s.to_string_lossy().into_owned())
    });
    let max_tokens_limit = a.max_tokens_limit.unwrap_or(ctx);
    if max_tokens_limit == 0 {
        bail!("--max-tokens-limit must be at least 1");
    }
    let max_tokens = a.max_tokens.unwrap_or(256.min(max_tokens_limit));
    if max_tokens == 0 || max_tokens > max_tokens_limit {
        bail!("--max-tokens {max_tokens} must be between 1 and --max-tokens-limit ({max_tokens_limit})");
    }
    let jobs = Arc::new(Queue::default());
    let bound = listener.local_addr().context("the listening socket has no address")?;
    let mut secrets: Vec<String> = vec![a.model.display().to_string()];
    secrets.extend(std::fs::canonicalize(&a.model).ok().map(|p| p.display().to_string()));
    secrets.extend(a.api_key_file.as_ref().map(|p| p.display().to_string()));
    secrets.extend(std::env::current_dir().ok().map(|p| p.display().to_string()));
    secrets.retain(|p| p.len() > 1);
    // Longest first, so a path is replaced before the directory it is in.
    secrets.sort_by_key(|p| std::cmp::Reverse(p.len()));
    let _ = SECRET_PATHS.set(secrets);
    let shared = Arc::new(Shared {
        model_id,
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        key,
        origins: a.allowed_origins.iter().filter_map(|o| normalize_origin(o)).collect(),
        bound,
        host_name: a.host.clone(),
        chat_options: ChatOptions {
            content: if a.special_tokens_in_content { ContentTokens::Special } else { ContentTokens::Text },
            enable_thinking: a.enable_thinking,
        },
        prompter: engine.prompter(),
        sampling,
        fixed_seed: a.sampling.seed.is_some(),
        max_tokens,
        max_tokens_limit,
        max_body: a.max_body as usize,
        ctx,
        queue: a.queue,
        jobs: jobs.clone(),
        budget: plan.as_ref().map(|p| p.memory_budget_bytes),
        memory: engine.model.memory_control(),
        watch: crate::memory::follow_memory(&engine, &a.memory, plan.as_ref().map(|p| p.memory_budget_bytes)),
    });
    let addr = bound;
    listener.set_nonblocking(true).context("cannot make the listening socket non-blocking")?;
    let app = router(shared.clone());
    let max_connections = a.max_connections;
    let closer = jobs.clone();
    let http = std::thread::Builder::new()
        .name("nflash-http".into())
        .spawn(move || -> Result<()> {
            let served = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("cannot start the HTTP runtime")
                .and_then(|rt| {
                    rt.block_on(async move {
                        let l =
                            tokio::net::TcpListener::from_std(listener).context("cannot use the listening socket")?;
                        serve_http(l, app, max_connections).await
                    })
                });
            closer.close();
            served
        })
        .context("cannot start the HTTP thread")?;
    message!(
        "nflash serve: {} on http://{addr} (context {ctx} tokens{}{}; {} request(s) may wait) — POST /v1/chat/completions, /v1/completions; GET /v1/models, /health; GET/POST /admin/memory (give memory back)",
        shared.model_id,
        shared.budget.map_or(String::new(), |b| format!(", memory budget {:.1} MiB", b as f64 / (1u64 << 20) as f64)),
        draft.as_ref().filter(|_| engine.draft.is_some()).map_or(String::new(), |d| format!(
            ", draft pack {} ({})",
            d.path().display(),
            a.speculative.speculate_draft.name()
        )),
        a.queue
    );
    let memory = Memory { watch: shared.watch.as_ref(), budget: shared.budget };
    generation_loop(&engine, &mut session, &jobs, memory, a.speculative.options());
    drop(shared);
    match http.join() {
        Ok(r) => r,
        Err(_) => bail!("the HTTP thread panicked"),
    }
}

/// Accepts connections (at most `max` open: more wait in the kernel's
/// backlog) and serves each with hyper's HTTP/1, closing those whose
/// request headers take longer than [`HEADER_TIMEOUT`] (idle ones too).
async fn serve_http(listener: tokio::net::TcpListener, app: Router, max: usize) -> Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(max));
    loop {
        let slot = slots.clone().acquire_owned().await.context("the connection limit was closed")?;
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: say so, wait, go on.
                message!("warning: cannot accept a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT);
            // Errors here are the client's (closed, timed out, malformed): nothing to report.
            let _ = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
            drop(slot);
        });
    }
}

/// The memory budget and its governor, for each request's timings.
#[derive(Clone, Copy)]
struct Memory<'a> {
    watch: Option<&'a Watch>,
    /// The plan's whole-process budget, bytes.
    budget: Option<u64>,
}

/// Runs jobs one at a time until the queue closes (the HTTP thread
/// stopped), each with the server's speculative decoding `spec`.
fn generation_loop(engine: &Engine, session: &mut Session, jobs: &Queue, memory: Memory, spec: SpecOptions) {
    while let Some(job) = jobs.take() {
        let t0 = Instant::now();
        let last = run_job(engine, session, &job, memory, spec);
        jobs.last_ms.store(t0.elapsed().as_millis() as u64, Ordering::Relaxed);
        // Idle before the client hears the end, so its next request finds room.
        jobs.lock().busy = false;
        let _ = job.events.send(last);
    }
}

/// One request: generate, streaming text back; cancelled when the client
/// is gone. Returns the last event ([`Event::Done`] or [`Event::Failed`]),
/// for the caller to send once the generation thread is idle.
fn run_job(engine: &Engine, session: &mut Session, job: &Job, memory: Memory, spec: SpecOptions) -> Event {
    let t0 = Instant::now();
    engine.model.reset_counters();
    if let (Some(w), Some(m)) = (memory.watch, engine.model.memory_control()) {
        w.take_window(m.held_bytes());
    }
    let mut sampler = Sampler::new(job.sampling);
    let opts = GenerateOptions {
        max_tokens: job.max_tokens,
        stop_ids: engine.stop_ids.clone(),
        ignore_eos: job.ignore_eos,
        cancel: job.cancel.clone(),
        speculate: spec,
    };
    let mut stops = StopScan::new(job.stop.clone());
    let result = session.generate(engine, &job.ids, &mut sampler, &opts, |piece| {
        let emit = stops.push(piece);
        if !emit.is_empty() && job.events.send(Event::Text(emit)).is_err() || job.events.is_closed() {
            job.cancel.cancel();
            return ControlFlow::Break(());
        }
        if stops.hit {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    match result {
        Ok(turn) => {
            let rest = stops.finish();
            if !rest.is_empty() {
                let _ = job.events.send(Event::Text(rest));
            }
            let finish_reason = match turn.stats.finish {
                _ if stops.hit => "stop",
                Finish::Stop | Finish::Cancelled => "stop",
                Finish::Length | Finish::ContextFull => "length",
            };
            let wall = t0.elapsed().as_secs_f64();
            let gone = turn.stats.finish == Finish::Cancelled && job.cancel.is_cancelled();
            let at = turn.stats.stopped_at;
            let cancelled = if !gone {
                String::new()
            } else if at < job.ids.len() {
                format!("; the client went away, generation cancelled in prefill at position {at} of {}", job.ids.len())
            } else {
                format!(
                    "; the client went away, generation cancelled at position {at} (after {} generated tokens)",
                    turn.tokens.len()
                )
            };
            message!(
                "job {}: {} prompt tokens ({} reused), {} generated at {:.1} tokens/s in {:.2} s{cancelled}",
                job.id,
                job.ids.len(),
                turn.reused_tokens,
                turn.tokens.len(),
                turn.stats.decode_tokens_per_s(),
                wall,
            );
            let held = engine.model.memory_control().map_or(0, |m| m.held_bytes());
            let timings = timings(job, &turn, (t0 - job.enqueued).as_secs_f64(), memory, held);
            Event::Done { prompt_tokens: job.ids.len(), completion_tokens: turn.tokens.len(), finish_reason, timings }
        }
        Err(e) => {
            message!("job {}: error: {e}", job.id);
            Event::Failed(scrub_paths(&e.to_string()))
        }
    }
}

/// nflash's timings of one request (the response's `timings` object),
/// with the memory budget over the request: its least and most (the
/// budget less what was given back, at its start, the governor's polls
/// and its end; the cache holds `held` bytes now), and the
/// shrinks, grows, bytes given back and clusters read again.
fn timings(job: &Job, turn: &Turn, queue_s: f64, memory: Memory, held: u64) -> Value {
    let st = &turn.stats;
    let held = memory.watch.map(|w| (w, w.take_window(held)));
    let budget = crate::memory::budget_json(memory.budget, held, &[&st.prefill_cache, &st.decode_cache]);
    let mut j = json!({
        "queue_ms": queue_s * 1e3,
        "prompt_tokens": job.ids.len(),
        "reused_tokens": turn.reused_tokens,
        "prefill_tokens": st.prompt_tokens,
        "prefill_ms": st.prefill_s * 1e3,
        "prefill_tokens_per_s": st.prefill_tokens_per_s(),
        "decode_ms": st.decode_s * 1e3,
        "decode_tokens_per_s": st.decode_tokens_per_s(),
        "cache_hit_rate": st.decode_cache.hit_rate(),
        "bytes_read": st.prefill_cache.bytes_read + st.decode_cache.bytes_read,
    });
    let o = j.as_object_mut().expect("an object");
    o.extend(crate::sampling::speculation_json(st));
    o.extend(budget);
    j
}

/// Finds stop strings in streamed text, holding back a tail that could be
/// the start of one, so no part of a stop string is ever sent.
struct StopScan {
    stops: Vec<String>,
    pending: String,
    hit: bool,
}

impl StopScan {
    fn new(stops: Vec<String>) -> Self {
        StopScan { stops, pending: String::new(), hit: false }
    }

    /// Text that can be sent after `piece`; sets `hit` at a stop string
    /// (the text before it is returned, the rest dropped).
    fn push(&mut self, piece: &str) -> String {
        if self.hit {
            return String::new();
        }
        self.pending.push_str(piece);
        if self.stops.is_empty() {
            return std::mem::take(&mut self.pending);
        }
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            self.hit = true;
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return out;
        }
        // Keep the longest tail that a stop string starts with.
        let keep = (1..=self.pending.len())
            .rev()
            .filter(|&n| self.pending.is_char_boundary(self.pending.len() - n))
            .find(|&n| self.stops.iter().any(|s| s.starts_with(&self.pending[self.pending.len() - n..])))
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        out
    }

    /// What is still held back, at the end of generation.
    fn finish(&mut self) -> String {
        if self.hit {
            String::new()
        } else {
            std::mem::take(&mut self.pending)
        }
    }
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/admin/memory", get(memory).post(trim_memory))
        .fallback(not_found)
        .method_not_allowed_fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(shared.clone(), guard))
        .with_state(shared)
}

/// An error response in OpenAI's shape: `{"error": {"message", "type", "code"}}`.
struct ApiError {
    status: StatusCode,
    message: String,
    retry_after: Option<u64>,
}

impl ApiError {
    fn bad(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), retry_after: None }
    }

    fn forbidden(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::FORBIDDEN, message: message.into(), retry_after: None }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::BAD_REQUEST | StatusCode::NOT_FOUND | StatusCode::UNSUPPORTED_MEDIA_TYPE => {
                "invalid_request_error"
            }
            StatusCode::SERVICE_UNAVAILABLE => "server_busy",
            _ => "server_error",
        };
        let message = scrub_paths(&self.message);
        let body = json!({"error": {"message": message, "type": kind, "code": self.status.as_u16()}});
        let mut r = (self.status, axum::Json(body)).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// Every request's checks, in order: the `Host` header (without an API
/// key: DNS rebinding), the `Origin` header (a page of another site:
/// 403 unless --allowed-origin lists it; CORS preflights from listed
/// origins are answered here, before the key, which browsers do not send
/// on preflights), then the API key on every route but `GET /health`.
/// Responses to listed origins carry `Access-Control-Allow-Origin`.
async fn guard(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    if s.key.is_none() {
        if let Err(e) = check_host(&s, req.headers()) {
            return e.into_response();
        }
    }
    let origin = match req.headers().get(header::ORIGIN) {
        None => None,
        Some(o) => {
            let o = o.to_str().ok().and_then(normalize_origin);
            match o.filter(|o| s.origins.contains(o)) {
                Some(o) => Some(o),
                None => {
                    return ApiError::forbidden(
                        "cross-origin request refused: this server answers pages of the origins given with --allowed-origin only",
                    )
                    .into_response()
                }
            }
        }
    };
    let preflight =
        req.method() == Method::OPTIONS && req.headers().contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut r = if let (true, Some(_)) = (preflight, &origin) {
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, OPTIONS"));
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, HeaderValue::from_static("authorization, content-type"));
        h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
        r
    } else if s.key.is_some() && !(req.uri().path() == "/health" && req.method() == Method::GET) {
        match check_key(&s, req.headers()) {
            Ok(()) => next.run(req).await,
            Err(e) => e.into_response(),
        }
    } else {
        next.run(req).await
    };
    let h = r.headers_mut();
    if let Some(o) = origin.and_then(|o| HeaderValue::from_str(&o).ok()) {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, o);
        h.insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, HeaderValue::from_static("retry-after"));
    }
    if !s.origins.is_empty() {
        h.append(header::VARY, HeaderValue::from_static("origin"));
    }
    r
}

/// `Origin` in a comparable form: scheme and host in lower case, no
/// trailing slash, the default port dropped; `None` if it is not
/// `scheme://host[:port]` (a path, `null`, `*`).
fn normalize_origin(o: &str) -> Option<String> {
    let o = o.trim().trim_end_matches('/').to_ascii_lowercase();
    let (scheme, rest) = o.split_once("://")?;
    if !matches!(scheme, "http" | "https") || rest.is_empty() || rest.contains(['/', '?', '#', '@', ' ']) {
        return None;
    }
    let rest = match (scheme, rest.rsplit_once(':')) {
        ("http", Some((h, "80"))) | ("https", Some((h, "443"))) if !h.is_empty() => h,
        _ => rest,
    };
    Some(format!("{scheme}://{rest}"))
}

/// Without an API key, a `Host` must name this machine (DNS rebinding: a
/// web site whose name resolves to 127.0.0.1 must not reach the server
/// as its own origin): a loopback address (127.0.0.0/8, [::1]),
/// `localhost` (or a name under `.localhost`), the bound address or the
/// --host name, any port. Requests without a Host (HTTP/1.0 tools) pass.
fn check_host(s: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(host) = headers.get(header::HOST) else { return Ok(()) };
    let host = host.to_str().unwrap_or("").trim().to_ascii_lowercase();
    // Strip the port: "[::1]:8080", "127.0.0.1:8080", "localhost:8080".
    let name = if let Some(v6) = host.strip_prefix('[') {
        v6.split_once(']').map_or("", |(a, rest)| if rest.is_empty() || rest.starts_with(':') { a } else { "" })
    } else {
        host.rsplit_once(':')
            .map_or(host.as_str(), |(h, port)| if port.bytes().all(|b| b.is_ascii_digit()) { h } else { "" })
    };
    let name = name.trim_end_matches('.');
    let ok = !name.is_empty()
        && (name == "localhost"
            || name.ends_with(".localhost")
            || name == s.host_name.to_ascii_lowercase()
            || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback() || ip == s.bound.ip()));
    if ok {
        Ok(())
    } else {
        Err(ApiError::forbidden(format!(
            "Host {host:?} refused: without an API key this server answers requests addressed to localhost or a loopback address only (a web site's name resolving to this machine must not reach it); start it with --api-key-file to accept other names"
        )))
    }
}

/// Checks `Authorization: Bearer KEY` against the server's key.
fn check_key(s: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.key else { return Ok(()) };
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or("").trim();
    // The scheme's name is case-insensitive (RFC 9110 §11.1).
    let given = match given.split_once(' ') {
        Some((scheme, key)) if scheme.eq_ignore_ascii_case("bearer") => key.trim(),
        _ => "",
    };
    // Compare in time independent of where the strings differ.
    let same = given.len() == key.len() && given.bytes().zip(key.bytes()).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0;
    if same {
        Ok(())
    } else {
        Err(ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or wrong API key: send the header `Authorization: Bearer KEY` with the key nflash serve was started with".into(),
            retry_after: None,
        })
    }
}

/// Paths of this server's files and directory (the pack, the key file,
/// the working directory), longest first: [`scrub_paths`] hides them.
static SECRET_PATHS: OnceLock<Vec<String>> = OnceLock::new();

/// `message` with file paths replaced by `<path>`, before it goes to a
/// client (the server's log keeps them): the paths of [`SECRET_PATHS`]
/// wherever they occur, and any absolute path of two or more components
/// (a word starting with `/`), except this server's routes (`/v1/…`,
/// `/health`).
fn scrub_paths(message: &str) -> String {
    let mut m = message.to_string();
    for p in SECRET_PATHS.get().map_or(&[][..], Vec::as_slice) {
        m = m.replace(p.as_str(), "<path>");
    }
    let mut out = String::with_capacity(m.len());
    let mut rest = m.as_str();
    while let Some(at) = rest.find('/') {
        let (before, from) = rest.split_at(at);
        out.push_str(before);
        let starts_word = before.chars().last().is_none_or(|c| !(c.is_alphanumeric() || "/._-~<>".contains(c)));
        let len = from.find(|c: char| c.is_whitespace() || "\"'`,;()[]{}<>".contains(c)).unwrap_or(from.len());
        let word = from[..len].trim_end_matches([':', '.']);
        let is_route = word == "/health" || word == "/v1" || word.starts_with("/v1/") || word == "/admin/memory";
        if starts_word && !is_route && word.len() > 1 && word[1..].contains('/') {
            out.push_str("<path>");
            rest = &from[word.len()..];
        } else {
            out.push('/');
            rest = &from[1..];
        }
    }
    out.push_str(rest);
    out
}

async fn not_found(req: Request) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "no endpoint {} {}: nflash serve has POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/ID, GET /health and GET/POST /admin/memory",
            req.method(),
            req.uri().path()
        ),
        retry_after: None,
    }
}

/// The neuron cache's memory: what it holds, its floor and ceiling, and an
/// app's cap (`null`: none), bytes.
fn memory_json(s: &Shared) -> Value {
    match &s.memory {
        Some(m) => json!({
            "held_bytes": m.held_bytes(),
            "floor_bytes": m.floor_bytes(),
            "ceiling_bytes": m.ceiling_bytes(),
            "cap_bytes": s.watch.as_ref().and_then(|w| w.cap()),
        }),
        None => json!({"held_bytes": null, "floor_bytes": null, "ceiling_bytes": null, "cap_bytes": null}),
    }
}

/// `GET /admin/memory`: [`memory_json`].
async fn memory(State(s): State<Arc<Shared>>) -> Response {
    axum::Json(memory_json(&s)).into_response()
}

/// `POST /admin/memory` with `{"bytes": N}` (cap the neuron cache at N
/// bytes; 0: its floor) or `{"level": L}` (an Android `onTrimMemory`
/// level; 0 lifts the cap), as libnflash's `nflash_trim_memory_to` and
/// `nflash_trim_memory_level` do: memory is given back at once, even while
/// a reply is being generated. Answers with [`memory_json`].
async fn trim_memory(State(s): State<Arc<Shared>>, req: Request) -> Response {
    let body = match read_body(&s, req).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return ApiError::bad(format!("the body is not JSON: {e}")).into_response(),
    };
    let Some(mem) = &s.memory else { return axum::Json(memory_json(&s)).into_response() };
    let cap = match (v.get("bytes"), v.get("level")) {
        (Some(b), None) => match whole_number(b).and_then(|b| u64::try_from(b).ok()) {
            Some(b) => b,
            None => return ApiError::bad("bytes must be a whole number of bytes from 0 to 2^64 - 1").into_response(),
        },
        (None, Some(l)) => match whole_number(l).and_then(|l| i32::try_from(l).ok()) {
            Some(l) => nflash_runtime::pressure::level_target(l, mem.floor_bytes(), mem.ceiling_bytes()),
            None => {
                return ApiError::bad(
                    "level must be an integer from -2^31 to 2^31 - 1 (Android's TRIM_MEMORY_* levels)",
                )
                .into_response()
            }
        },
        _ => return ApiError::bad("give one of bytes (a cap, 0: the floor) or level (onTrimMemory's)").into_response(),
    };
    nflash_runtime::pressure::apply_cap(mem.as_ref(), s.watch.as_ref(), cap);
    axum::Json(memory_json(&s)).into_response()
}

/// A JSON number that is whole, in any notation (`100000000`, `1e8`,
/// `100000000.0` as Python's `json` writes a float, `-0`); `None` for a
/// fraction, a non-number, or a magnitude of 2^64 or more.
fn whole_number(v: &Value) -> Option<i128> {
    if let Some(u) = v.as_u64() {
        return Some(u.into());
    }
    if let Some(i) = v.as_i64() {
        return Some(i.into());
    }
    let f = v.as_f64()?;
    (f.is_finite() && f.fract() == 0.0 && f.abs() < 2f64.powi(64)).then_some(f as i128)
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    axum::Json(json!({
        "status": "ok",
        "model": s.model_id,
        "busy": s.jobs.lock().busy,
        "waiting": s.jobs.lock().jobs.len(),
        "queue": s.queue,
        "context_tokens": s.ctx,
        "memory_budget_bytes": s.budget,
        "peak_rss_bytes": nflash_runtime::stats::peak_rss_bytes(),
    }))
    .into_response()
}

fn model_card(s: &Shared) -> Value {
    json!({"id": s.model_id, "object": "model", "created": s.created, "owned_by": "nflash"})
}

async fn models(State(s): State<Arc<Shared>>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_card(&s)]})).into_response()
}

async fn model(State(s): State<Arc<Shared>>, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    if id == s.model_id {
        axum::Json(model_card(&s)).into_response()
    } else {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no model {id:?}: this server has one, {:?}", s.model_id),
            retry_after: None,
        }
        .into_response()
    }
}

/// The request fields both endpoints take (OpenAI's names; others are ignored).
#[derive(Deserialize)]
struct Params {
    stream: Option<bool>,
    tools: Option<Value>,
    logprobs: Option<Value>,
    echo: Option<bool>,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u64>,
    seed: Option<i64>,
    n: Option<u64>,
    stop: Option<Value>,
    /// nflash (and llama-server) extension: keep going past end-of-sequence tokens.
    #[serde(default)]
    ignore_eos: bool,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct ChatRequest {
    messages: Vec<ChatMessage>,
    /// Variables for the chat template (vLLM's and llama.cpp's name):
    /// `enable_thinking` only.
    #[serde(default)]
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// The request's `enable_thinking` (`chat_template_kwargs`), else the server's.
fn enable_thinking(r: &ChatRequest, default: Option<bool>) -> Result<Option<bool>, ApiError> {
    let Some(kw) = &r.chat_template_kwargs else { return Ok(default) };
    if let Some(k) = kw.keys().find(|k| k.as_str() != "enable_thinking") {
        return Err(ApiError::bad(format!(
            "chat_template_kwargs.{}: not supported; the one template variable a request may set is enable_thinking",
            k.chars().take(64).collect::<String>()
        )));
    }
    match kw.get("enable_thinking") {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::bad("chat_template_kwargs.enable_thinking must be true or false")),
    }
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Value,
}

#[derive(Deserialize)]
struct CompletionRequest {
    prompt: Value,
}

/// Which endpoint a reply is for.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat(State(s): State<Arc<Shared>>, req: Request) -> Response {
    let r = async {
        let (r, p): (ChatRequest, _) = parse(&read_body(&s, req).await?)?;
        if r.messages.is_empty() {
            return Err(ApiError::bad("messages is empty: send at least one message"));
        }
        let msgs = r
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                if !ROLES.contains(&m.role.as_str()) {
                    return Err(ApiError::bad(format!(
                        "messages[{i}].role {:?} is not a role; use one of {}",
                        m.role.chars().take(64).collect::<String>(),
                        ROLES.join(", ")
                    )));
                }
                Ok(Message::new(&m.role, &content_text(&m.content, i)?))
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        let opts =
            ChatOptions { enable_thinking: enable_thinking(&r, s.chat_options.enable_thinking)?, ..s.chat_options };
        let s2 = s.clone();
        let ids = blocking(move || s2.prompter.encode_chat_with(&msgs, s2.ctx - 1, opts))
            .await?
            .map_err(|e| match e {
                nflash_runtime::Error::PromptTooLong { prompt, .. } => too_long(&s, prompt),
                e => ApiError::bad(format!("messages: the pack's chat template cannot render them: {e}")),
            })?
            .ok_or_else(|| {
                ApiError::bad("this pack has no chat template (a base model): use /v1/completions with a prompt")
            })?;
        submit(&s, ids, &p, Kind::Chat).await
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(s): State<Arc<Shared>>, req: Request) -> Response {
    let r = async {
        let (r, p): (CompletionRequest, _) = parse(&read_body(&s, req).await?)?;
        let prompt = match &r.prompt {
            Value::String(p) => p.as_str(),
            Value::Array(a) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or(""),
            _ => return Err(ApiError::bad("prompt must be a string (one prompt per request)")),
        };
        if prompt.is_empty() {
            return Err(ApiError::bad("prompt is empty"));
        }
        let (s2, prompt) = (s.clone(), prompt.to_string());
        let ids =
            blocking(move || s2.prompter.encode_raw_at_most(&prompt, s2.ctx - 1)).await?.map_err(|e| match e {
                nflash_runtime::Error::PromptTooLong { prompt, .. } => too_long(&s, prompt),
                e => ApiError::bad(format!("prompt: {e}")),
            })?;
        submit(&s, ids, &p, Kind::Completion).await
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

/// Runs `f` (tokenizing: up to a second for a long prompt) off the HTTP thread.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| failed(format!("tokenizing the request failed: {e}")))
}

/// 400 for a prompt of (at least) `tokens` tokens.
fn too_long(s: &Shared, tokens: usize) -> ApiError {
    ApiError::bad(format!(
        "the prompt is {tokens} tokens or more; this server's context holds {} (--ctx) with at least one for the reply: shorten the conversation",
        s.ctx
    ))
}

/// The request body, at most --max-body bytes; 415 unless it is declared
/// `Content-Type: application/json` (parameters such as charset allowed).
async fn read_body(s: &Shared, req: Request) -> Result<Bytes, ApiError> {
    let ct = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if !ct.split(';').next().unwrap_or("").trim().eq_ignore_ascii_case("application/json") {
        return Err(ApiError {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            message: format!(
                "the request body must be sent with `Content-Type: application/json` (got {:?})",
                ct.chars().take(64).collect::<String>()
            ),
            retry_after: None,
        });
    }
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| n > s.max_body as u64) {
        return Err(ApiError::bad(format!(
            "the request body is {n} bytes, over the limit of {} bytes (--max-body)",
            s.max_body
        )));
    }
    match tokio::time::timeout(BODY_TIMEOUT, axum::body::to_bytes(req.into_body(), s.max_body)).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => Err(ApiError::bad(format!(
            "cannot read the request body: {e} (the limit is {} bytes, --max-body)",
            s.max_body
        ))),
        Err(_) => Err(ApiError::bad(format!("the request body did not arrive within {} s", BODY_TIMEOUT.as_secs()))),
    }
}

/// How long a request's headers may take to arrive (then the connection is closed).
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request's body may take to arrive (then 400).
const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Parses a JSON object into the endpoint's fields and the shared
/// [`Params`], naming the field at fault.
fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<(T, Params), ApiError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("the request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad("the request body must be a JSON object"));
    }
    Ok((typed(&v)?, typed(&v)?))
}

fn typed<T: DeserializeOwned>(v: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| match e.path().to_string().as_str() {
        "." => ApiError::bad(e.inner().to_string()),
        path => ApiError::bad(format!("{path}: {}", e.inner())),
    })
}

/// A message's text: a string, an array of `{"type": "text", "text": …}`
/// parts, or null (an assistant message with only tool calls).
fn content_text(c: &Value, i: usize) -> Result<String, ApiError> {
    match c {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                (Some("text"), Some(t)) => Ok(t),
                _ => Err(ApiError::bad(format!(
                    "messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported"
                ))),
            })
            .collect::<Result<String, _>>(),
        _ => Err(ApiError::bad(format!("messages[{i}].content must be a string or an array of text parts"))),
    }
}

/// Checks the request's bounds, queues it and answers (streamed or whole).
async fn submit(s: &Arc<Shared>, ids: Vec<u32>, p: &Params, kind: Kind) -> Result<Response, ApiError> {
    if p.tools.as_ref().is_some_and(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(ApiError::bad(
            "tools (function calling) are not supported by nflash serve; send the request without them",
        ));
    }
    if p.logprobs.as_ref().is_some_and(|l| !matches!(l, Value::Null | Value::Bool(false))) {
        return Err(ApiError::bad("logprobs are not supported by nflash serve; send the request without them"));
    }
    if p.echo == Some(true) {
        return Err(ApiError::bad("echo is not supported by nflash serve; send the request without it"));
    }
    if p.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("n must be 1: nflash serve generates one choice per request"));
    }
    let max_tokens = match p.max_completion_tokens.or(p.max_tokens) {
        None => s.max_tokens,
        Some(0) => return Err(ApiError::bad("max_tokens must be at least 1")),
        Some(m) if m > s.max_tokens_limit as u64 => {
            return Err(ApiError::bad(format!(
                "max_tokens {m} is over this server's limit of {} (--max-tokens-limit)",
                s.max_tokens_limit
            )))
        }
        Some(m) => m as usize,
    };
    if ids.len() + 1 > s.ctx {
        return Err(ApiError::bad(format!(
            "the prompt is {} tokens; this server's context holds {} (--ctx) with at least one for the reply: shorten the conversation",
            ids.len(),
            s.ctx
        )));
    }
    let mut sampling = s.sampling;
    if let Some(t) = p.temperature {
        if !nflash_runtime::sampler::valid_temperature(t) {
            return Err(ApiError::bad(format!("temperature {t} must be a finite number ≥ 0 (0 = greedy)")));
        }
        sampling.temperature = t;
    }
    if let Some(t) = p.top_p {
        if !nflash_runtime::sampler::valid_top_p(t) {
            return Err(ApiError::bad(format!("top_p {t} must be in (0, 1]")));
        }
        sampling.top_p = t;
    }
    if let Some(k) = p.top_k {
        sampling.top_k = k.min(u32::MAX as u64) as usize;
    }
    sampling.seed = match p.seed {
        Some(seed) => seed as u64,
        None if s.fixed_seed => s.sampling.seed,
        None => clock_seed(),
    };
    let stop = stop_strings(p.stop.as_ref())?;
    let (tx, rx) = unbounded_channel();
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let cancel = CancelToken::new();
    let job = Job {
        id,
        ids,
        ignore_eos: p.ignore_eos,
        sampling,
        max_tokens,
        stop,
        events: tx,
        enqueued: Instant::now(),
        cancel: cancel.clone(),
    };
    if !s.jobs.push(job, s.queue) {
        let waiting = s.jobs.lock().jobs.len() as u64 + 1;
        let secs = (s.jobs.last_ms.load(Ordering::Relaxed) * waiting).div_ceil(1000).max(1);
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!(
                "busy: one request is generating and {} are waiting (--queue {}); retry later",
                s.queue, s.queue
            ),
            retry_after: Some(secs),
        });
    }
    let waiter = Waiter { queue: s.jobs.clone(), id, cancel };
    let include_usage = p.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let id = format!("{}-{}-{id}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }, s.created);
    if p.stream == Some(true) {
        Ok(stream_response(s, rx, kind, include_usage, id, waiter))
    } else {
        let r = whole_response(s, rx, kind, &id).await;
        drop(waiter);
        r
    }
}

/// `stop`: a string or an array of up to 4 non-empty strings.
fn stop_strings(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect()
        }
        _ => return Err(ApiError::bad("stop must be a string or an array of strings")),
    };
    if list.len() > 4 || list.iter().any(|s| s.is_empty() || s.len() > 256) {
        return Err(ApiError::bad("stop takes at most 4 strings, each 1 to 256 bytes"));
    }
    Ok(list)
}

/// `id`, `object`, `created` and `model` of a response or chunk.
fn envelope(s: &Shared, kind: Kind, stream: bool, id: &str) -> serde_json::Map<String, Value> {
    let object = match (kind, stream) {
        (Kind::Chat, false) => "chat.completion",
        (Kind::Chat, true) => "chat.completion.chunk",
        (Kind::Completion, _) => "text_completion",
    };
    let mut m = serde_json::Map::new();
    m.insert("id".into(), json!(id));
    m.insert("object".into(), json!(object));
    m.insert("created".into(), json!(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())));
    m.insert("model".into(), json!(s.model_id));
    m
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens})
}

fn failed(message: String) -> ApiError {
    ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message, retry_after: None }
}

/// Waits for the whole reply and answers with one JSON object.
async fn whole_response(
    s: &Shared,
    mut rx: UnboundedReceiver<Event>,
    kind: Kind,
    id: &str,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Event::Text(t)) => text.push_str(&t),
            Some(Event::Done { prompt_tokens, completion_tokens, finish_reason, timings }) => {
                let mut m = envelope(s, kind, false, id);
                let choice = match kind {
                    Kind::Chat => {
                        json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason})
                    }
                    Kind::Completion => {
                        json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason})
                    }
                };
                m.insert("choices".into(), json!([choice]));
                m.insert("usage".into(), usage(prompt_tokens, completion_tokens));
                m.insert("timings".into(), timings);
                return Ok(axum::Json(Value::Object(m)).into_response());
            }
            Some(Event::Failed(e)) => return Err(failed(e)),
            None => return Err(failed("the generation thread stopped before answering; restart nflash serve".into())),
        }
    }
}

/// Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.
fn stream_response(
    s: &Arc<Shared>,
    rx: UnboundedReceiver<Event>,
    kind: Kind,
    include_usage: bool,
    id: String,
    waiter: Waiter,
) -> Response {
    let s = s.clone();
    let id = Arc::new(id);
    let sse = |v: &Value| format!("data: {v}\n\n");
    let chunk = {
        let (s, id) = (s.clone(), id.clone());
        move |delta: Value, finish: Value| {
            let mut m = envelope(&s, kind, true, &id);
            let choice = match kind {
                Kind::Chat => json!({"index": 0, "delta": delta, "finish_reason": finish}),
                Kind::Completion => json!({
                    "index": 0,
                    "text": delta.get("content").cloned().unwrap_or(json!("")),
                    "logprobs": null,
                    "finish_reason": finish
                }),
            };
            m.insert("choices".into(), json!([choice]));
            Value::Object(m)
        }
    };
    let head = match kind {
        Kind::Chat => sse(&chunk(json!({"role": "assistant", "content": ""}), Value::Null)),
        Kind::Completion => String::new(),
    };
    let events = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(move |ev| {
        // The stream holds the waiter: a client that hangs up drops both.
        let _ = &waiter;
        let out = match ev {
            Event::Text(t) => sse(&chunk(json!({"content": t}), Value::Null)),
            Event::Done { prompt_tokens, completion_tokens, finish_reason, timings } => {
                let mut last = chunk(json!({}), json!(finish_reason));
                last["usage"] = usage(prompt_tokens, completion_tokens);
                last["timings"] = timings;
                let mut out = sse(&last);
                if include_usage {
                    let mut u = envelope(&s, kind, true, &id);
                    u.insert("choices".into(), json!([]));
                    u.insert("usage".into(), usage(prompt_tokens, completion_tokens));
                    out += &sse(&Value::Object(u));
                }
                out + "data: [DONE]\n\n"
            }
            Event::Failed(e) => {
                sse(&json!({"error": {"message": scrub_paths(&e), "type": "server_error", "code": 500}}))
                    + "data: [DONE]\n\n"
            }
        };
        Ok::<_, Infallible>(Bytes::from(out))
    });
    let body = Body::from_stream(tokio_stream::iter([Ok(Bytes::from(head))]).chain(events));
    let mut r = Response::new(body);
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

#[cfg(test)]
mod tests {
    use super::{normalize_origin, scrub_paths, StopScan};

    #[test]
    fn paths_are_scrubbed_but_routes_and_text_stay() {
        assert_eq!(
            scrub_paths("reading FFN layer 3 failed: /home/me/models/smol.nflash: unexpected end of file"),
            "reading FFN layer 3 failed: <path>: unexpected end of file"
        );
        assert_eq!(scrub_paths("cannot open \"/tmp/x/y\" (os error 2)"), "cannot open \"<path>\" (os error 2)");
        let keep = "use /v1/completions with a prompt; GET /health; 3/4 and a/b and 1 / 2 and /v1";
        assert_eq!(scrub_paths(keep), keep);
        assert_eq!(scrub_paths("io_uring_setup: denied"), "io_uring_setup: denied");
    }

    #[test]
    fn origins_normalize() {
        assert_eq!(normalize_origin("HTTP://LocalHost:3000/").as_deref(), Some("http://localhost:3000"));
        assert_eq!(normalize_origin("https://a.example:443").as_deref(), Some("https://a.example"));
        for bad in ["*", "null", "http://a.example/path", "file://", "a.example", "http://"] {
            assert_eq!(normalize_origin(bad), None, "{bad}");
        }
    }

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopScan::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            out += &s.push(p);
        }
        out += &s.finish();
        (out, s.hit)
    }

    #[test]
    fn stop_strings_split_across_pieces_are_never_sent() {
        assert_eq!(run(&["END"], &["ab", "cE", "N", "Dxyz"]), ("abc".into(), true));
        assert_eq!(run(&["END"], &["ab", "cE", "Nx"]), ("abcENx".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["\n\n", "é!"], &["xé", "!"]), ("x".into(), true));
        assert_eq!(run(&["zz"], &["éé"]), ("éé".into(), false));
    }
}
