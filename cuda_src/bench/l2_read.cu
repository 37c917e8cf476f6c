// The L2 reset of the timing harness (qgemm.bench.clear_l2, QGEMM_BENCH_L2=read): every thread
// reads its 16-byte chunks of a zeroed buffer twice the L2's size, so the timing after it starts
// from the same L2 state whatever ran before (clean lines of that buffer). Off by default: on the
// H100 a reset like this left hot rows with 17-33 MB of weights slower than the bench's own
// order does (docs/perf/NOTES.md, session 11).

extern "C" __global__ void l2_read(const uint4* __restrict__ buf, size_t n, unsigned* __restrict__ sink) {
    unsigned acc = 0u;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = buf[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    // the loads must not be dead code: the buffer is all zeros, so this never stores
    if (acc == 0x9E3779B9u) *sink = acc;
}
