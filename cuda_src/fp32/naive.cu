// Step 1, rung 0: C[M,N] = A[M,K] * W[N,K]^T, one thread per output, straight from global memory.
//
// threadIdx.x walks N so that C stores are coalesced; each thread reads its own W row with
// stride K, which is why this is the slowest rung: every W element is fetched M times.
extern "C" __global__ void fp32_naive(const float* __restrict__ A, const float* __restrict__ W,
                                      float* __restrict__ C, int M, int N, int K) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y * blockDim.y + threadIdx.y;
    if (m >= M || n >= N) return;
    const float* a = A + (size_t)m * K;
    const float* w = W + (size_t)n * K;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc = fmaf(a[k], w[k], acc);
    C[(size_t)m * N + n] = acc;
}
