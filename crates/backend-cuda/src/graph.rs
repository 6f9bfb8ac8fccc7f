//! CUDA graphs for decode steps: a device layer ([`Graphed`]) between the counters and the device that,
//! between [`Graphed::begin`] and the step's first host wait, records the step's kernel launches, copies
//! and uploads instead of issuing them, then builds them into one graph and launches it; the next step
//! of the same shape (its key: the number of sequences) is matched op by op against the graph and
//! replayed. A decode step changes few launches' arguments from one token to the next (the attention's
//! past length, the KV write position, the rotary rows and page tables it uploads): those nodes are
//! updated in the instantiated graph in place (`cuGraphExecKernelNodeSetParams`), not re-captured, so
//! a steady decode is built once and replayed for every token after. An op of another kind or kernel
//! than the graph's node at its place (a new attention variant, a sequence that left) re-records the
//! step from there; the graph is rebuilt when the step ends.
//!
//! Uploads inside a graph come from this layer's page-locked staging memory (the graph's copy nodes
//! read it when they run, so the host writes each step's bytes there before the launch and does not
//! touch them until the graph has run). Fences recorded inside a step are placeholders until the graph
//! launches, then the event after it: a slot's last reader is "the step's graph" (later, never early).
//! Work a graph cannot hold — a download or any host wait, a copy on the copy stream, a wait for one, a
//! cuBLAS GEMM, a free — ends the step's graph first and runs eagerly (a decode step with every expert
//! resident waits once, for its sampled ids, at its end). The emulated device runs a graph's nodes as it
//! would the same launches (`EmuDevice::graph_launch`): replay equals eager decode bit for bit.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use osprey_backend::HostArena;

use crate::device::{Arg, DevPtr, DeviceError, DeviceInfo, DeviceLayer, Event, GemmBf16, GraphId, LaunchConfig, Node};

impl Node {
    /// Whether `other` can take this node's place by updating its parameters (the same kind of node,
    /// the same kernel).
    fn same_kind(&self, other: &Node) -> bool {
        match (self, other) {
            (Node::Kernel { name: a, .. }, Node::Kernel { name: b, .. }) => a == b,
            (Node::Upload { .. }, Node::Upload { .. })
            | (Node::Copy { .. }, Node::Copy { .. })
            | (Node::Zero { .. }, Node::Zero { .. }) => true,
            _ => false,
        }
    }
}

/// What graphs did since start (tests, `bench`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphCounts {
    /// Graphs built (instantiated): a first step of a shape, or one whose ops changed.
    pub built: u64,
    /// Graphs launched (each a step's work up to its first host wait).
    pub launched: u64,
    /// Nodes of launched graphs (kernels, copies, uploads, zeroes).
    pub nodes: u64,
    /// Nodes updated in place before a replay (arguments, sizes, addresses).
    pub updated: u64,
}

/// Staging memory per step shape for the uploads its graph holds (4 MiB: a decode step uploads its
/// token ids, rotary rows, page tables and sampling settings, a few KiB a sequence and 32 KiB a grammar
/// mask at Qwen3.5's vocabulary). An upload that does not fit ends the graph there.
const STAGING: usize = 4 << 20;

/// Step shapes kept (each its graph and staging); the least recently begun goes first.
const SHAPES: usize = 8;

/// Fences handed out inside a step carry this tag until its graph launches.
const PLACEHOLDER: u64 = 1 << 62;

/// One step shape's graph.
#[derive(Debug)]
struct Step {
    nodes: Vec<Node>,
    exec: Option<GraphId>,
    staging: HostArena,
    /// When it was last begun (for eviction).
    used: u64,
}

#[derive(Debug)]
enum Mode {
    /// Ops go to the device.
    Eager,
    /// Recording the step of shape `key`.
    Capture { key: u64 },
    /// Matching the step against its graph: `matched` nodes so far, those in `changed` updated.
    Replay { key: u64, matched: usize, changed: Vec<usize> },
}

#[derive(Debug)]
struct State {
    mode: Mode,
    steps: HashMap<u64, Step>,
    /// The next byte of the step's staging memory.
    cursor: usize,
    /// Placeholder fences of the step being recorded.
    pending: Vec<u64>,
    next_placeholder: u64,
    /// Placeholders whose graph has launched → the event after it.
    resolved: BTreeMap<u64, Event>,
    /// The event after the last graph launched (its staging is free once it completes).
    last: Option<Event>,
    begun: u64,
    counts: GraphCounts,
    /// The thread whose step is being recorded: another thread's op (the vision tower shares the
    /// backend) ends the step's graph and runs eagerly, so a graph holds one step's work alone.
    owner: Option<std::thread::ThreadId>,
}

/// The graph-recording device layer (see the module docs).
#[derive(Debug)]
pub struct Graphed {
    inner: Arc<dyn DeviceLayer>,
    enabled: AtomicBool,
    state: Mutex<State>,
}

impl Graphed {
    /// Over `inner`; with `enabled` false every op goes straight through.
    pub fn new(inner: Arc<dyn DeviceLayer>, enabled: bool) -> Self {
        let state = State {
            mode: Mode::Eager,
            steps: HashMap::new(),
            cursor: 0,
            pending: Vec::new(),
            next_placeholder: 0,
            resolved: BTreeMap::new(),
            last: None,
            begun: 0,
            counts: GraphCounts::default(),
            owner: None,
        };
        Graphed { inner, enabled: AtomicBool::new(enabled), state: Mutex::new(state) }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Turns graphs on or off (from the next step).
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// What graphs did since start.
    pub fn counts(&self) -> GraphCounts {
        self.state().counts
    }

    /// The work from here to the next host wait (or [`Graphed::end`]) is a step of shape `key`: recorded
    /// the first time, replayed after. No-op when graphs are off.
    pub fn begin(&self, key: u64) -> Result<(), DeviceError> {
        if !self.enabled.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut s = self.state();
        self.flush(&mut s)?;
        // The staging memory is rewritten below: the graph that read it last must have run.
        if let Some(last) = s.last.take() {
            if !self.inner.is_complete(last) {
                self.inner.synchronize(last)?;
            }
        }
        s.begun += 1;
        let begun = s.begun;
        if let Some(step) = s.steps.get_mut(&key) {
            step.used = begun;
            s.mode = match step.exec {
                Some(_) => Mode::Replay { key, matched: 0, changed: Vec::new() },
                None => Mode::Capture { key },
            };
        } else {
            if s.steps.len() >= SHAPES {
                let oldest = s.steps.iter().min_by_key(|(_, st)| st.used).map(|(k, _)| *k);
                if let Some(exec) = oldest.and_then(|k| s.steps.remove(&k)).and_then(|st| st.exec) {
                    self.inner.graph_drop(exec);
                }
            }
            let staging = self.inner.alloc_host(STAGING)?;
            s.steps.insert(key, Step { nodes: Vec::new(), exec: None, staging, used: begun });
            s.mode = Mode::Capture { key };
        }
        s.cursor = 0;
        s.owner = Some(std::thread::current().id());
        Ok(())
    }

    /// Ends the step: its graph, if any is pending, is built or updated and launched.
    pub fn end(&self) -> Result<(), DeviceError> {
        let mut s = self.state();
        self.flush(&mut s)
    }

    /// Takes `node` into the step being recorded or matched: `Ok(false)` when no step is, or when it
    /// cannot (its upload does not fit the staging memory: the graph ends here), and the caller issues
    /// the op itself.
    fn take(&self, mut node: Node, bytes: Option<&[u8]>) -> Result<bool, DeviceError> {
        let mut s = self.state();
        let key = match s.mode {
            Mode::Eager => return Ok(false),
            Mode::Capture { key } | Mode::Replay { key, .. } => key,
        };
        if s.owner != Some(std::thread::current().id()) {
            self.flush(&mut s)?;
            return Ok(false);
        }
        if let (Some(b), Node::Upload { at, .. }) = (bytes, &mut node) {
            let start = s.cursor;
            if start + b.len() > STAGING {
                self.flush(&mut s)?;
                return Ok(false);
            }
            let step = s.steps.get_mut(&key).ok_or_else(|| bug("a step without its graph"))?;
            // SAFETY: the staging memory is `STAGING` bytes, `start + len` fits (checked), and no graph
            // reading it runs (`begin` waited for the last one).
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), step.staging.as_ptr().add(start), b.len()) };
            *at = start;
            s.cursor = (start + b.len()).next_multiple_of(16);
        }
        let State { mode, steps, .. } = &mut *s;
        let step = steps.get_mut(&key).ok_or_else(|| bug("a step without its graph"))?;
        if let Mode::Replay { matched, changed, .. } = mode {
            let i = *matched;
            match step.nodes.get_mut(i) {
                Some(old) if old.same_kind(&node) => {
                    if *old != node {
                        *old = node;
                        changed.push(i);
                    }
                    *matched += 1;
                    return Ok(true);
                }
                // Another op here: the step is recorded anew from this point, its graph rebuilt.
                _ => {
                    step.nodes.truncate(i);
                    if let Some(exec) = step.exec.take() {
                        self.inner.graph_drop(exec);
                    }
                    *mode = Mode::Capture { key };
                }
            }
        }
        step.nodes.push(node);
        Ok(true)
    }

    /// Ends the step's graph: builds (or updates) it, launches it, and resolves its fences.
    fn flush(&self, s: &mut State) -> Result<(), DeviceError> {
        let (key, rebuild, changed) = match std::mem::replace(&mut s.mode, Mode::Eager) {
            Mode::Eager => return Ok(()),
            Mode::Capture { key } => (key, true, Vec::new()),
            Mode::Replay { key, matched, changed } => {
                let step = s.steps.get_mut(&key).ok_or_else(|| bug("a step without its graph"))?;
                // A step that ended sooner than its graph: the graph is rebuilt from what ran.
                let short = matched < step.nodes.len();
                step.nodes.truncate(matched);
                (key, short, changed)
            }
        };
        let step = s.steps.get_mut(&key).ok_or_else(|| bug("a step without its graph"))?;
        if step.nodes.is_empty() {
            if let Some(exec) = step.exec.take() {
                self.inner.graph_drop(exec);
            }
            return self.resolve(s, None);
        }
        let exec = match (rebuild, step.exec) {
            (false, Some(exec)) => {
                for &i in &changed {
                    self.inner.graph_update(exec, i, &step.nodes[i])?;
                }
                s.counts.updated += changed.len() as u64;
                exec
            }
            (_, old) => {
                if let Some(old) = old {
                    self.inner.graph_drop(old);
                }
                let exec = self.inner.graph_build(&step.nodes, step.staging.as_ptr())?;
                step.exec = Some(exec);
                s.counts.built += 1;
                exec
            }
        };
        let nodes = step.nodes.len() as u64;
        self.inner.graph_launch(exec)?;
        s.counts.launched += 1;
        s.counts.nodes += nodes;
        let after = self.inner.record()?;
        s.last = Some(after);
        self.resolve(s, Some(after))
    }

    /// The step's placeholder fences become `after` (none: no work was recorded, they are complete).
    fn resolve(&self, s: &mut State, after: Option<Event>) -> Result<(), DeviceError> {
        let done = Event(0);
        for p in std::mem::take(&mut s.pending) {
            s.resolved.insert(p, after.unwrap_or(done));
        }
        // Old fences whose event has completed read as complete when pruned (as the driver's do).
        if s.resolved.len() > 4096 {
            let inner = &self.inner;
            s.resolved.retain(|_, e| !inner.is_complete(*e));
        }
        Ok(())
    }

    /// The device's event for `e` (a placeholder once resolved); `None`: complete.
    fn real(&self, e: Event) -> Option<Event> {
        if e.0 & PLACEHOLDER == 0 || e.is_copy() {
            return Some(e);
        }
        self.state().resolved.get(&e.0).copied().filter(|r| r.0 != 0)
    }

    /// Ends any step being recorded, then runs `f` on the device (an op a graph cannot hold).
    fn eager<T>(&self, f: impl FnOnce(&dyn DeviceLayer) -> Result<T, DeviceError>) -> Result<T, DeviceError> {
        {
            let mut s = self.state();
            self.flush(&mut s)?;
        }
        f(&*self.inner)
    }
}

fn bug(what: &str) -> DeviceError {
    DeviceError::Bounds(format!("graphs: {what}"))
}

impl DeviceLayer for Graphed {
    fn info(&self) -> DeviceInfo {
        self.inner.info()
    }
    fn free_memory(&self) -> usize {
        self.inner.free_memory()
    }
    fn alloc(&self, bytes: usize) -> Result<DevPtr, DeviceError> {
        self.inner.alloc(bytes)
    }
    fn free(&self, p: DevPtr) -> Result<(), DeviceError> {
        // A recorded op may name it: the graph runs first.
        self.eager(|d| d.free(p))
    }
    fn alloc_host(&self, bytes: usize) -> Result<HostArena, DeviceError> {
        self.inner.alloc_host(bytes)
    }
    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        if self.take(Node::Upload { dst, at: 0, len: src.len() }, Some(src))? {
            return Ok(());
        }
        self.inner.upload(dst, src)
    }
    unsafe fn upload_async(&self, dst: DevPtr, src: *const u8, len: usize) -> Result<Event, DeviceError> {
        // SAFETY: the caller's contract, passed on.
        self.eager(|d| unsafe { d.upload_async(dst, src, len) })
    }
    fn wait_event(&self, e: Event) -> Result<(), DeviceError> {
        self.eager(|d| self.real(e).map_or(Ok(()), |e| d.wait_event(e)))
    }
    fn copies_after(&self, e: Event) -> Result<(), DeviceError> {
        self.eager(|d| self.real(e).map_or(Ok(()), |e| d.copies_after(e)))
    }
    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.eager(|d| d.download(src, dst))
    }
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        if self.take(Node::Copy { dst, src, bytes }, None)? {
            return Ok(());
        }
        self.inner.copy(dst, src, bytes)
    }
    fn zero(&self, dst: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        if self.take(Node::Zero { dst, bytes }, None)? {
            return Ok(());
        }
        self.inner.zero(dst, bytes)
    }
    fn gemm_bf16(&self, g: GemmBf16) -> Result<(), DeviceError> {
        self.eager(|d| d.gemm_bf16(g))
    }
    fn launch(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<(), DeviceError> {
        if self.take(Node::Kernel { name: name.to_string(), cfg, args: args.to_vec() }, None)? {
            return Ok(());
        }
        self.inner.launch(name, cfg, args)
    }
    fn record(&self) -> Result<Event, DeviceError> {
        let mut s = self.state();
        if s.owner != Some(std::thread::current().id()) {
            self.flush(&mut s)?;
        }
        if matches!(s.mode, Mode::Eager) {
            drop(s);
            return self.inner.record();
        }
        s.next_placeholder += 1;
        let p = PLACEHOLDER | s.next_placeholder;
        s.pending.push(p);
        Ok(Event(p))
    }
    fn is_complete(&self, e: Event) -> bool {
        if e.0 & PLACEHOLDER != 0 && !e.is_copy() && self.state().pending.contains(&e.0) {
            return false; // its graph has not launched
        }
        self.real(e).is_none_or(|e| self.inner.is_complete(e))
    }
    fn synchronize(&self, e: Event) -> Result<(), DeviceError> {
        self.eager(|d| self.real(e).map_or(Ok(()), |e| d.synchronize(e)))
    }
    fn traffic(&self) -> Option<crate::Traffic> {
        self.inner.traffic()
    }
    // The `graph_*` methods keep their defaults: this layer builds graphs on `inner`, and no layer above
    // it asks for one.
}
