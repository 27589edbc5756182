//! Convolutions on cuDNN (feature `cudnn`): the forward, the input gradient (cuDNN's "backward
//! data") and the kernel gradient ("backward filter") of one NCHW convolution, each writing a
//! fresh output in the operands' dtype. The conv op (`kernels::conv`) calls these from its CUDA
//! forwards, so a convolution is one graph node on CUDA as on the CPU.
//!
//! As PyTorch configures cuDNN: half and bfloat16 data accumulate in f32 (cuDNN's "pseudo half"
//! configurations) on tensor cores; f32 data may use TF32 tensor cores, PyTorch's default for
//! convolutions (`torch.backends.cudnn.allow_tf32`), switched by
//! `candle_amp::backends::cudnn::set_allow_tf32`. Algorithms
//! are cuDNN's heuristic choice (`cudnnGet*Algorithm_v7`, what PyTorch uses without
//! `cudnn.benchmark`), asked once per device, dtype, math mode, shape and pass and cached with
//! their workspace sizes (in cuDNN 9 each query is a heuristics call of its own on the host).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cudnn::{
    sys, ConvBackwardData, ConvBackwardFilter, ConvDescriptor, ConvForward, Cudnn, CudnnDataType,
    FilterDescriptor, TensorDescriptor,
};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, DeviceId};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, WithDType};

/// One 2-D convolution's sizes as cuDNN describes them: `x (n, c_in, h, w)`, the kernel
/// `w (c_out, c_in / groups, kh, kw)`, `y (n, c_out, out_h, out_w)`, and the same padding,
/// stride and dilation along both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ConvShape {
    pub x: [usize; 4],
    pub w: [usize; 4],
    pub y: [usize; 4],
    pub padding: usize,
    pub stride: usize,
    pub dilation: usize,
    pub groups: usize,
}

/// The three computations on one [`ConvShape`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Pass {
    /// `(x, w) -> y`.
    Forward,
    /// `(w, dy) -> dx`.
    Data,
    /// `(x, dy) -> dw`.
    Filter,
}

/// An algorithm of one [`Pass`].
#[derive(Clone, Copy, Debug)]
enum Algo {
    Forward(sys::cudnnConvolutionFwdAlgo_t),
    Data(sys::cudnnConvolutionBwdDataAlgo_t),
    Filter(sys::cudnnConvolutionBwdFilterAlgo_t),
}

/// What an algorithm is chosen for: the device, the data's dtype, whether f32 may use TF32 (the
/// descriptor's math mode), the shape and the pass.
type AlgoKey = (DeviceId, DType, bool, ConvShape, Pass);

// cuDNN handles are neither Send nor Sync: one per thread and device, as candle keeps its own.
thread_local! {
    static HANDLES: RefCell<HashMap<DeviceId, Arc<Cudnn>>> = RefCell::new(HashMap::new());
    static ALGOS: RefCell<HashMap<AlgoKey, (Algo, usize)>> = RefCell::new(HashMap::new());
}

/// This thread's cuDNN handle on `dev`, bound to the device's stream.
fn handle(dev: &CudaDevice) -> Result<Arc<Cudnn>> {
    HANDLES.with(|handles| {
        if let Some(h) = handles.borrow().get(&dev.id()) {
            return Ok(h.clone());
        }
        let h = Cudnn::new(dev.cuda_stream())?;
        handles.borrow_mut().insert(dev.id(), h.clone());
        Ok(h)
    })
}

/// The cached algorithm for `key` and its workspace bytes, or `pick`'s answer, cached.
fn algorithm(key: AlgoKey, pick: impl FnOnce() -> Result<(Algo, usize)>) -> Result<(Algo, usize)> {
    if let Some(a) = ALGOS.with(|algos| algos.borrow().get(&key).copied()) {
        return Ok(a);
    }
    let a = pick()?;
    ALGOS.with(|algos| algos.borrow_mut().insert(key, a));
    Ok(a)
}

/// `v` as cuDNN's `int`, or an error naming the shape.
fn int(v: usize, s: &ConvShape) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        candle_core::Error::Msg(format!("cudnn conv: {s:?} exceeds cuDNN's int sizes"))
    })
}

fn dims(d: [usize; 4], s: &ConvShape) -> Result<[i32; 4]> {
    Ok([int(d[0], s)?, int(d[1], s)?, int(d[2], s)?, int(d[3], s)?])
}

/// The descriptors of one convolution on `T` data, f32 arithmetic.
struct Descriptors<T: CudnnDataType> {
    conv: ConvDescriptor<f32>,
    x: TensorDescriptor<T>,
    w: FilterDescriptor<T>,
    y: TensorDescriptor<T>,
}

impl<T: CudnnDataType> Descriptors<T> {
    fn new(cudnn: &Arc<Cudnn>, s: &ConvShape, dtype: DType, tf32: bool) -> Result<Self> {
        use sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW as NCHW;
        let (p, st, d) = (int(s.padding, s)?, int(s.stride, s)?, int(s.dilation, s)?);
        let mut conv = cudnn.create_conv2d::<f32>(
            [p, p],
            [st, st],
            [d, d],
            sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
        )?;
        conv.set_group_count(int(s.groups, s)?)?;
        let math = match dtype {
            DType::F32 if tf32 => sys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
            DType::F32 => sys::cudnnMathType_t::CUDNN_FMA_MATH,
            _ => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        };
        conv.set_math_type(math)?;
        Ok(Self {
            conv,
            x: cudnn.create_4d_tensor::<T>(NCHW, dims(s.x, s)?)?,
            w: cudnn.create_4d_filter::<T>(NCHW, dims(s.w, s)?)?,
            y: cudnn.create_4d_tensor::<T>(NCHW, dims(s.y, s)?)?,
        })
    }
}

/// The contiguous values of `storage` from `layout`'s start, checked to hold `len` of them.
fn view<'a, T: CudaDType>(
    (storage, layout): (&'a CudaStorage, &Layout),
    len: usize,
) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("cudnn conv: operands must be contiguous")
    };
    if end - start != len {
        candle_core::bail!(
            "cudnn conv: an operand of {} values where {len} were expected",
            end - start
        )
    }
    Ok(storage.as_cuda_slice::<T>()?.slice(start..end))
}

/// A workspace of `bytes` (none for 0).
fn workspace(dev: &CudaDevice, bytes: usize) -> Result<Option<CudaSlice<u8>>> {
    if bytes == 0 {
        return Ok(None);
    }
    // SAFETY: cuDNN's workspace is scratch it writes before it reads.
    Ok(Some(unsafe { dev.alloc::<u8>(bytes) }?))
}

/// One pass on `T` data: `a` and `b` are the pass's two operands in [`Pass`]'s order.
fn run<T>(
    pass: Pass,
    a: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    s: &ConvShape,
) -> Result<CudaStorage>
where
    T: CudnnDataType + CudaDType + DeviceRepr + WithDType,
{
    let dev = &a.0.device;
    let cudnn = handle(dev)?;
    let count = |d: [usize; 4]| d.iter().product::<usize>();
    let (nx, nw, ny) = (count(s.x), count(s.w), count(s.y));
    let tf32 = T::DTYPE == DType::F32 && crate::backends::cudnn::allow_tf32();
    let d = Descriptors::<T>::new(&cudnn, s, T::DTYPE, tf32)?;
    let key = (dev.id(), T::DTYPE, tf32, *s, pass);
    let one_zero = (T::from_f64(1.0), T::from_f64(0.0));
    let (len_a, len_b, len_out) = match pass {
        Pass::Forward => (nx, nw, ny),
        Pass::Data => (nw, ny, nx),
        Pass::Filter => (nx, ny, nw),
    };
    let (va, vb) = (view::<T>(a, len_a)?, view::<T>(b, len_b)?);
    // SAFETY: every element of `out` is written by the cuDNN call below, whose beta is 0 (cuDNN
    // does not read the output then).
    let mut out = unsafe { dev.alloc::<T>(len_out) }?;
    match pass {
        Pass::Forward => {
            let op = ConvForward {
                conv: &d.conv,
                x: &d.x,
                w: &d.w,
                y: &d.y,
            };
            let (Algo::Forward(algo), bytes) = algorithm(key, || {
                let algo = op.pick_algorithm()?;
                Ok((Algo::Forward(algo), op.get_workspace_size(algo)?))
            })?
            else {
                unreachable!("the forward pass caches forward algorithms")
            };
            let mut ws = workspace(dev, bytes)?;
            // SAFETY: the descriptors describe `va`, `vb` and `out` (dtype `T`, NCHW, the
            // lengths `view` checked and `out` was allocated with).
            unsafe { op.launch(algo, ws.as_mut(), one_zero, &va, &vb, &mut out) }?;
        }
        Pass::Data => {
            let op = ConvBackwardData {
                conv: &d.conv,
                dx: &d.x,
                w: &d.w,
                dy: &d.y,
            };
            let (Algo::Data(algo), bytes) = algorithm(key, || {
                let algo = op.pick_algorithm()?;
                Ok((Algo::Data(algo), op.get_workspace_size(algo)?))
            })?
            else {
                unreachable!("the data pass caches data algorithms")
            };
            let mut ws = workspace(dev, bytes)?;
            // SAFETY: as for the forward.
            unsafe { op.launch(algo, ws.as_mut(), one_zero, &mut out, &va, &vb) }?;
        }
        Pass::Filter => {
            let op = ConvBackwardFilter {
                conv: &d.conv,
                x: &d.x,
                dw: &d.w,
                dy: &d.y,
            };
            let (Algo::Filter(algo), bytes) = algorithm(key, || {
                let algo = op.pick_algorithm()?;
                Ok((Algo::Filter(algo), op.get_workspace_size(algo)?))
            })?
            else {
                unreachable!("the filter pass caches filter algorithms")
            };
            let mut ws = workspace(dev, bytes)?;
            // SAFETY: as for the forward.
            unsafe { op.launch(algo, ws.as_mut(), one_zero, &va, &mut out, &vb) }?;
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// `pass` on storages of one float dtype.
fn dispatch(
    pass: Pass,
    a: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    s: &ConvShape,
) -> Result<CudaStorage> {
    if a.0.dtype() != b.0.dtype() {
        candle_core::bail!(
            "cudnn conv: operands of one dtype, got {:?} and {:?}",
            a.0.dtype(),
            b.0.dtype()
        )
    }
    match a.0.dtype() {
        DType::F32 => run::<f32>(pass, a, b, s),
        DType::F16 => run::<half::f16>(pass, a, b, s),
        DType::BF16 => run::<half::bf16>(pass, a, b, s),
        other => candle_core::bail!("cudnn conv: f32, f16 or bf16, got {other:?}"),
    }
}

/// `y = conv(x, w)`, shape `s.y`.
pub(crate) fn forward(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    s: &ConvShape,
) -> Result<CudaStorage> {
    dispatch(Pass::Forward, x, w, s)
}

/// The input gradient `dx` (shape `s.x`) for the output gradient `dy`.
pub(crate) fn backward_data(
    w: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    s: &ConvShape,
) -> Result<CudaStorage> {
    dispatch(Pass::Data, w, dy, s)
}

/// The kernel gradient `dw` (shape `s.w`, in the operands' dtype) for the output gradient `dy`.
pub(crate) fn backward_filter(
    x: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    s: &ConvShape,
) -> Result<CudaStorage> {
    dispatch(Pass::Filter, x, dy, s)
}
