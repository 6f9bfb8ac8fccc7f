//! CUDA graphs on a real device (`crate::graph`'s nodes as `cuGraphAdd*Node`s in a chain, instantiated
//! once, updated in place with `cuGraphExec*NodeSetParams`, launched on the compute stream). Built and
//! linted in CI; never run against a driver yet (docs/cuda.md).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use cudarc::driver::sys;

use super::CudaDevice;
use crate::device::{DeviceError, GraphId, LaunchConfig, Node};

/// A built graph: the graph, its executable, its nodes in order, its staging memory.
pub(crate) struct DriverGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    nodes: Vec<sys::CUgraphNode>,
    staging: usize,
}

// SAFETY: the handles are used only under the device's graph mutex, with the context bound.
unsafe impl Send for DriverGraph {}

/// The device's graphs by id.
#[derive(Default)]
pub(crate) struct Graphs {
    next: AtomicU64,
    built: Mutex<HashMap<u64, DriverGraph>>,
}

fn failed(what: &str, e: sys::CUresult) -> DeviceError {
    DeviceError::Unavailable(format!("{what}: {e:?}"))
}

fn check(what: &str, r: sys::CUresult) -> Result<(), DeviceError> {
    r.result().map_err(|e| failed(what, e.0))
}

/// A node's copy: host staging or device memory to device memory, `len` bytes in one row.
fn copy_params(dst: u64, src_host: Option<*const u8>, src_device: u64, len: usize) -> sys::CUDA_MEMCPY3D {
    // SAFETY: an all-zero CUDA_MEMCPY3D is valid (null arrays, zero offsets); the fields below set it up.
    let mut p: sys::CUDA_MEMCPY3D = unsafe { std::mem::zeroed() };
    match src_host {
        Some(h) => {
            p.srcMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_HOST;
            p.srcHost = h.cast();
        }
        None => {
            p.srcMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
            p.srcDevice = src_device;
        }
    }
    p.dstMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    p.dstDevice = dst;
    (p.WidthInBytes, p.Height, p.Depth) = (len, 1, 1);
    p
}

fn memset_params(dst: u64, bytes: usize) -> sys::CUDA_MEMSET_NODE_PARAMS {
    sys::CUDA_MEMSET_NODE_PARAMS { dst, pitch: 0, value: 0, elementSize: 1, width: bytes, height: 1 }
}

impl CudaDevice {
    /// A kernel node's parameters; `values` holds the arguments (each read at its own size from the low
    /// bytes) and must outlive the call that takes them (the driver copies them).
    fn kernel_params(
        &self,
        name: &str,
        cfg: LaunchConfig,
        values: &mut [u64],
        ptrs: &mut Vec<*mut std::ffi::c_void>,
    ) -> Result<sys::CUDA_KERNEL_NODE_PARAMS, DeviceError> {
        let f = self.function(name)?;
        // The driver reads one parameter per kernel argument from `values`: a count that differs would
        // have it read past them (a launch checks the same, `DeviceLayer::launch`).
        let arity = crate::kernels::find(name).map_or(usize::MAX, |k| k.arity);
        if values.len() != arity {
            let message = format!("{} arguments for {arity} parameters: this is a bug", values.len());
            return Err(DeviceError::Kernel { kernel: name.into(), message });
        }
        ptrs.clear();
        ptrs.extend(values.iter_mut().map(|v| (v as *mut u64).cast::<std::ffi::c_void>()));
        // SAFETY: an all-zero node description is valid; the fields below set it up.
        let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
        p.func = f;
        (p.gridDimX, p.gridDimY, p.gridDimZ) = (cfg.grid[0], cfg.grid[1], cfg.grid[2]);
        (p.blockDimX, p.blockDimY, p.blockDimZ) = (cfg.block[0], cfg.block[1], cfg.block[2]);
        p.kernelParams = ptrs.as_mut_ptr();
        Ok(p)
    }

    /// [`crate::DeviceLayer::graph_build`].
    pub(crate) fn build_graph(&self, nodes: &[Node], staging: *const u8) -> Result<GraphId, DeviceError> {
        self.bind()?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: an out-pointer to a fresh handle.
        check("creating a graph", unsafe { sys::cuGraphCreate(&mut graph, 0) })?;
        let mut g = DriverGraph { graph, exec: std::ptr::null_mut(), nodes: Vec::new(), staging: staging as usize };
        let built = self.add_nodes(&mut g, nodes).and_then(|()| {
            // SAFETY: a complete graph of this context.
            check("instantiating a graph", unsafe { sys::cuGraphInstantiateWithFlags(&mut g.exec, g.graph, 0) })
        });
        if let Err(e) = built {
            // SAFETY: created above, destroyed once.
            unsafe { sys::cuGraphDestroy(g.graph) };
            return Err(e);
        }
        let id = self.graphs.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.graphs.built.lock().unwrap_or_else(|e| e.into_inner()).insert(id, g);
        Ok(GraphId(id))
    }

    fn add_nodes(&self, g: &mut DriverGraph, nodes: &[Node]) -> Result<(), DeviceError> {
        let ctx = self.cu_ctx();
        let mut ptrs = Vec::new();
        for n in nodes {
            let mut node: sys::CUgraphNode = std::ptr::null_mut();
            let deps = g.nodes.last().map_or(std::ptr::null(), |d| d as *const sys::CUgraphNode);
            let ndeps = usize::from(!g.nodes.is_empty());
            // SAFETY (each arm): `g.graph` is live; `deps` names its last node (or none); the parameters are
            // complete and the driver copies them before returning.
            let r = match n {
                Node::Kernel { name, cfg, args } => {
                    let mut values: Vec<u64> = args.iter().map(|a| a.bits()).collect();
                    let p = self.kernel_params(name, *cfg, &mut values, &mut ptrs)?;
                    unsafe { sys::cuGraphAddKernelNode_v2(&mut node, g.graph, deps, ndeps, &p) }
                }
                Node::Upload { dst, at, len } => {
                    let p = copy_params(dst.0, Some((g.staging + at) as *const u8), 0, *len);
                    unsafe { sys::cuGraphAddMemcpyNode(&mut node, g.graph, deps, ndeps, &p, ctx) }
                }
                Node::Copy { dst, src, bytes } => {
                    let p = copy_params(dst.0, None, src.0, *bytes);
                    unsafe { sys::cuGraphAddMemcpyNode(&mut node, g.graph, deps, ndeps, &p, ctx) }
                }
                Node::Zero { dst, bytes } => {
                    let p = memset_params(dst.0, *bytes);
                    unsafe { sys::cuGraphAddMemsetNode(&mut node, g.graph, deps, ndeps, &p, ctx) }
                }
            };
            check("adding a graph node", r)?;
            g.nodes.push(node);
        }
        Ok(())
    }

    /// [`crate::DeviceLayer::graph_update`].
    pub(crate) fn update_graph(&self, id: GraphId, i: usize, n: &Node) -> Result<(), DeviceError> {
        self.bind()?;
        let graphs = self.graphs.built.lock().unwrap_or_else(|e| e.into_inner());
        let g = graphs.get(&id.0).ok_or_else(|| DeviceError::Bounds(format!("graph {} is gone", id.0)))?;
        let node = *g.nodes.get(i).ok_or_else(|| DeviceError::Bounds(format!("node {i} of graph {}", id.0)))?;
        let ctx = self.cu_ctx();
        let mut ptrs = Vec::new();
        // SAFETY (each arm): a live executable and one of its nodes, of the kind updated; the parameters
        // are complete and copied by the driver.
        let r = match n {
            Node::Kernel { name, cfg, args } => {
                let mut values: Vec<u64> = args.iter().map(|a| a.bits()).collect();
                let p = self.kernel_params(name, *cfg, &mut values, &mut ptrs)?;
                unsafe { sys::cuGraphExecKernelNodeSetParams_v2(g.exec, node, &p) }
            }
            Node::Upload { dst, at, len } => {
                let p = copy_params(dst.0, Some((g.staging + at) as *const u8), 0, *len);
                unsafe { sys::cuGraphExecMemcpyNodeSetParams(g.exec, node, &p, ctx) }
            }
            Node::Copy { dst, src, bytes } => {
                let p = copy_params(dst.0, None, src.0, *bytes);
                unsafe { sys::cuGraphExecMemcpyNodeSetParams(g.exec, node, &p, ctx) }
            }
            Node::Zero { dst, bytes } => {
                let p = memset_params(dst.0, *bytes);
                unsafe { sys::cuGraphExecMemsetNodeSetParams(g.exec, node, &p, ctx) }
            }
        };
        check("updating a graph node", r)
    }

    /// [`crate::DeviceLayer::graph_launch`].
    pub(crate) fn launch_graph(&self, id: GraphId) -> Result<(), DeviceError> {
        self.bind()?;
        let graphs = self.graphs.built.lock().unwrap_or_else(|e| e.into_inner());
        let g = graphs.get(&id.0).ok_or_else(|| DeviceError::Bounds(format!("graph {} is gone", id.0)))?;
        // SAFETY: a live executable on this context's compute stream.
        check("launching a graph", unsafe { sys::cuGraphLaunch(g.exec, self.cu_stream()) })
    }

    /// [`crate::DeviceLayer::graph_drop`].
    pub(crate) fn drop_graph(&self, id: GraphId) {
        let g = self.graphs.built.lock().unwrap_or_else(|e| e.into_inner()).remove(&id.0);
        if let (Some(g), Ok(())) = (g, self.bind()) {
            // SAFETY: created by `build_graph`, destroyed once (launches before it complete first: the
            // driver defers the release of an executable still running).
            unsafe {
                sys::cuGraphExecDestroy(g.exec);
                sys::cuGraphDestroy(g.graph);
            }
        }
    }
}
