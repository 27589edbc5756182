//! What the kernels read of candle's layouts: contiguous runs, strided offsets, overlap; and
//! whether an output's shape can be allocated at all.

use candle_core::Layout;

/// The storage offsets a strided layout addresses, in row-major order of its shape.
pub(crate) fn strided_offsets(layout: &Layout) -> impl Iterator<Item = usize> + '_ {
    let (dims, stride) = (layout.dims(), layout.stride());
    let mut index = vec![0usize; dims.len()];
    let mut offset = layout.start_offset();
    (0..layout.shape().elem_count()).map(move |_| {
        let current = offset;
        // Odometer increment: bump the last dimension, carrying into earlier ones.
        for d in (0..dims.len()).rev() {
            index[d] += 1;
            offset += stride[d];
            if index[d] < dims[d] {
                break;
            }
            offset -= stride[d] * dims[d];
            index[d] = 0;
        }
        current
    })
}

/// The elements of a contiguous layout: the ops make their operands contiguous before they
/// reach a kernel, so anything else is a bug in the op, reported as an error naming `op`.
pub(crate) fn contiguous<'a, T>(
    data: &'a [T],
    layout: &Layout,
    op: &str,
) -> candle_core::Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("{op} kernel: operand not contiguous"),
    }
}

/// The elements a layout addresses, in row-major order of its shape: the storage itself when
/// contiguous, gathered into a new vector otherwise.
pub(crate) fn elements<'a, T: Copy>(data: &'a [T], layout: &Layout) -> std::borrow::Cow<'a, [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => std::borrow::Cow::Borrowed(&data[start..end]),
        None => std::borrow::Cow::Owned(strided_offsets(layout).map(|i| data[i]).collect()),
    }
}

/// Whether every element of `layout` has its own storage slot (no broadcast or overlapping
/// strides), so that an in-place update touches each element exactly once.
pub(crate) fn is_non_overlapping(layout: &Layout) -> bool {
    let mut dims: Vec<(usize, usize)> = layout
        .dims()
        .iter()
        .zip(layout.stride())
        .filter(|(&d, _)| d > 1)
        .map(|(&d, &s)| (s, d))
        .collect();
    dims.sort_unstable();
    let mut span = 1;
    for (stride, dim) in dims {
        if stride < span {
            return false;
        }
        span = stride * dim;
    }
    true
}

/// Bytes no allocation can reach: the 47-bit user address space of x86-64 and aarch64 Linux.
const ADDRESSABLE: u128 = 1 << 47;

/// Fails, naming `op`, when a tensor of `dims` could not exist: its element count overflows, or
/// its f32 elements would exceed the address space. The geometry checks of the ops whose output
/// size grows with their arguments (padding, stride, dilation, an adaptive pool's size) call it,
/// so that an absurd argument is an error rather than an arithmetic overflow's panic, a
/// capacity overflow or an allocation's abort.
pub(crate) fn check_allocatable(op: &str, dims: &[usize]) -> candle_core::Result<()> {
    let elements = dims
        .iter()
        .try_fold(1u128, |n, &d| n.checked_mul(d as u128));
    match elements.and_then(|n| n.checked_mul(4)) {
        Some(bytes) if bytes <= ADDRESSABLE => Ok(()),
        _ => candle_core::bail!("{op}: an output of shape {dims:?} is too large to allocate"),
    }
}

/// `view`, a narrowing of `source` (`narrow`, `chunk`, `i`), as it is unless it holds no element
/// at a non-zero offset. candle keeps a narrowing's offset however empty the storage under it
/// (`(0, 3)` narrowed to its second column: offset 1 into 0 elements) and still calls the view
/// contiguous, and every kernel that then reads it slices past the storage's end and panics.
/// Such a view is rebuilt as the empty view of `source` at its start, of the same dimensions:
/// no element either way, and the graph kept (`source` gets its zero gradient).
pub(crate) fn empty_at_start(
    view: candle_core::Tensor,
    source: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    if view.elem_count() > 0 || view.layout().start_offset() == 0 {
        return Ok(view);
    }
    source.flatten_all()?.narrow(0, 0, 0)?.reshape(view.dims())
}
