// nmk_sample: one token per row drawn on the GPU, one launch per call. A row's vocab is split
// into slices, one CTA each (up to kMaxSlices, as many as the SMs allow for all rows at once);
// after each pass the row's CTAs meet at a barrier in global memory (row_sync) and every one of
// them reads the same combined result: partial maxima and sums by slice in slice order, radix
// histograms added with integer atomics. A row of one slice runs without the scratch.
//
// Passes over a row (each a read of V floats, from L2 right after the megakernel):
//   raw max, argmax and sum exp (greedy token, logprob)                          always
//     and in the same pass the Gumbel-max over the whole row                     top_p, no top_k
//   the mass above that winner against ceil(top_p * Z); kept (and by min_p),
//     it is the token and the passes below do not run                            top_p, no top_k
//   radix select of the top_k threshold: 3 passes (digits of 11, 11, 10 bits)    0 < top_k < V
//   radix search of the top_p threshold over fixed-point masses: 3 passes         top_p < 1
//   Gumbel-max over the kept tokens, skipping those that cannot win              sampled rows
// The whole row's winner, when kept, is the kept tokens' winner (every kept token is among
// the row's and none scores above it), so both ways draw the same token; top_p drops it in
// about 1 - top_p of the draws. The other rules keep the radix searches: a temperature-only
// draw folded into the first pass measured no faster, and top_k's check (a counting pass)
// gained on peaked rows but lost more on flat ones, whose winner top_k mostly drops.
// Once a radix level bounds the kept tokens from below and at most kCandidates lie above
// that bound, the next pass copies them to shared memory and later passes read only them.
// Everything that decides the token uses correctly rounded fp32 + - * / only (the __f*_rn
// intrinsics, never contracted to FMA; no hardware log or exp), and masses are integers, so
// the result does not depend on the summation order and northmk/engine/gpu_sampling.py
// (reference_draw) reproduces it bit for bit. Hardware log/exp only estimate (the logprob,
// agreeing to 1e-5, and a pre-check with a proven margin before the exact Gumbel noise).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "sample/sample.hpp"

namespace nmk::sample {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32;
constexpr int kBins = 2048;              // the widest radix digit, 11 bits
constexpr uint32_t kMaxSlices = 32;      // CTAs per row
constexpr uint32_t kMinSlice = 2048;     // logits per CTA at least: below that a row stays whole
constexpr uint32_t kCandidates = 2048;   // tokens a row keeps in shared memory
constexpr uint32_t kNone = 0xffffffffu;  // no token / no bin
constexpr float kInf = __builtin_huge_valf();

// ---- the deterministic math; the same constants, as hex literals, are in gpu_sampling.py ----
constexpr float kLn2 = 0x1.62e430p-1f, kLog2e = 0x1.715476p+0f;
constexpr float kLn2Hi = 0x1.62e000p-1f, kLn2Lo = 0x1.0bfbe8p-15f;  // kLn2Hi * n is exact for |n| < 2^11
constexpr float kInv3 = 0x1.555556p-2f, kInv5 = 0x1.99999ap-3f, kInv7 = 0x1.24924ap-3f, kInv9 = 0x1.c71c72p-4f;
constexpr float kInv6 = 0x1.555556p-3f, kInv24 = 0x1.555556p-5f, kInv120 = 0x1.111112p-7f;
constexpr float kInv720 = 0x1.6c16c2p-10f, kInv5040 = 0x1.a01a02p-13f;
constexpr float kMassCut = -28.0f;     // exp(d) below 2^-40 weighs nothing in top_p
constexpr float kMassScale = 0x1p39f;  // a token's top_p mass: trunc(exp(s - max s) * 2^39)
constexpr float kMaxGumbel = 17.0f;    // above every gumbel() value (16.64 at u = 1 - 2^-24)

// log(x) for finite x > 0 within a few ulp: x = 2^k m, m in [sqrt(1/2), sqrt(2)),
// log(m) = 2 atanh(s) with s = (m - 1) / (m + 1), |s| < 0.172, as a series in s^2 up to s^9.
__device__ float det_log(float x) {
    int k = 0;
    if (x < 0x1p-126f) x = __fmul_rn(x, 0x1p24f), k = -24;  // subnormal: scale exactly
    const uint32_t b = __float_as_uint(x) - 0x3f3504f3u;     // 0x3f3504f3: sqrt(1/2)
    k += static_cast<int32_t>(b) >> 23;
    const float f = __fsub_rn(__uint_as_float((b & 0x007fffffu) + 0x3f3504f3u), 1.0f);  // m - 1, exact
    const float s = __fdiv_rn(f, __fadd_rn(2.0f, f)), z = __fmul_rn(s, s);
    float p = __fadd_rn(kInv7, __fmul_rn(z, kInv9));
    p = __fadd_rn(kInv5, __fmul_rn(z, p));
    p = __fadd_rn(kInv3, __fmul_rn(z, p));
    p = __fadd_rn(1.0f, __fmul_rn(z, p));
    return __fadd_rn(__fmul_rn(static_cast<float>(k), kLn2), __fmul_rn(__fmul_rn(2.0f, s), p));
}

// exp(d) for d in [kMassCut, 0]: d = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to r^7.
__device__ float det_exp(float d) {
    const float n = rintf(__fmul_rn(d, kLog2e));
    const float r = __fsub_rn(__fsub_rn(d, __fmul_rn(n, kLn2Hi)), __fmul_rn(n, kLn2Lo));
    float p = __fadd_rn(kInv720, __fmul_rn(r, kInv5040));
    p = __fadd_rn(kInv120, __fmul_rn(r, p));
    p = __fadd_rn(kInv24, __fmul_rn(r, p));
    p = __fadd_rn(kInv6, __fmul_rn(r, p));
    p = __fadd_rn(0.5f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    return __fmul_rn(p, __uint_as_float(static_cast<uint32_t>(static_cast<int>(n) + 127) << 23));
}

__device__ uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Token i's uniform: 23 hash bits + 1/2, over 2^23, lies in (0, 1) exactly in fp32.
__device__ float uniform(uint64_t key, uint32_t i) {
    const uint64_t h = splitmix64(key ^ i);
    return __fmul_rn(__fadd_rn(static_cast<float>(static_cast<uint32_t>(h >> 41)), 0.5f), 0x1p-23f);
}

__device__ float gumbel(float u) { return -det_log(-det_log(u)); }

// The value every rule compares: logit * (1 / temperature), NaN as -inf, -0 as +0 (so that
// the order of keys is the order of values).
__device__ float scaled(float x, float inv_t) {
    const float s = __fmul_rn(isnan(x) ? -kInf : x, inv_t);
    return s == 0.0f ? 0.0f : s;
}

// Monotone map of floats to uint32 keys and back.
__device__ uint32_t order_key(float s) {
    const uint32_t b = __float_as_uint(s);
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
__device__ float key_value(uint32_t k) { return __uint_as_float((k & 0x80000000u) ? k & 0x7fffffffu : ~k); }

// A token's integer top_p weight, d = s - max s.
__device__ uint64_t token_mass(float d) {
    if (!(d >= kMassCut)) return 0;
    return static_cast<uint64_t>(__fmul_rn(det_exp(d), kMassScale));
}

// ---- block-wide pieces ----
struct Shared {
    uint32_t count[kBins];
    uint32_t mass_lo[kBins], mass_hi[kBins];  // 64-bit masses as two 32-bit halves (native atomics)
    float cand_s[kCandidates];        // the candidate list of this CTA's slice: scaled logits, ids
    uint32_t cand_i[kCandidates];     // (a level that bounds the row's list to kCandidates bounds each slice's)
    uint32_t num_cand;                // kNone: the candidates are all the slice's logits
    uint32_t fill;                    // list entries written by the current pass
    float red_v[kWarps], red_sum[kWarps];
    uint32_t red_i[kWarps];
    unsigned long long red_mass[kWarps], red_above[kWarps];
    uint32_t head_kept;                 // nucleus_keeps' answer
    uint32_t digit, rank, at_or_above;  // radix level: chosen bin, rank left in it, tokens in and above it
    unsigned long long base, limit;     // top_p: mass above the current prefix, ceil(top_p * Z)
};

// Calls f(x, i) for every logit of the slice [lo, hi) of the row, i ascending per thread. kLoads
// 16-byte loads are in flight per thread: a CTA needs that many to draw on L2's bandwidth.
constexpr uint32_t kLoads = 4;
template <class F>
__device__ __forceinline__ void for_each_logit(const float *row, uint32_t vocab, uint32_t lo, uint32_t hi, F &&f) {
    if ((vocab & 3u) == 0 && (reinterpret_cast<uintptr_t>(row) & 15u) == 0) {  // lo, hi: multiples of 4
        const float4 *v = reinterpret_cast<const float4 *>(row);
        const uint32_t n = hi / 4;
        auto use = [&](float4 x, uint32_t j) {
            f(x.x, 4 * j), f(x.y, 4 * j + 1), f(x.z, 4 * j + 2), f(x.w, 4 * j + 3);
        };
        uint32_t j = lo / 4 + threadIdx.x;
        for (; j + (kLoads - 1) * kThreads < n; j += kLoads * kThreads) {
            float4 x[kLoads];
#pragma unroll
            for (uint32_t u = 0; u < kLoads; u++) x[u] = __ldcg(v + j + u * kThreads);
#pragma unroll
            for (uint32_t u = 0; u < kLoads; u++) use(x[u], j + u * kThreads);
        }
        for (; j < n; j += kThreads) use(__ldcg(v + j), j);
    } else {
        for (uint32_t i = lo + threadIdx.x; i < hi; i += kThreads) f(row[i], i);
    }
}

struct RowView {
    const float *logits;
    uint32_t vocab, lo, hi;  // this CTA's slice [lo, hi) of the row
    float inv_t;             // 1 / temperature, correctly rounded
};

// Calls f(s, i) for every candidate: the row's scaled logits, or the list once there is one.
template <class F>
__device__ __forceinline__ void for_each_candidate(const RowView &r, const Shared &sh, F &&f) {
    const uint32_t n = sh.num_cand;
    if (n != kNone) {
        for (uint32_t c = threadIdx.x; c < n; c += kThreads) f(sh.cand_s[c], sh.cand_i[c]);
    } else {
        for_each_logit(r.logits, r.vocab, r.lo, r.hi, [&](float x, uint32_t i) { f(scaled(x, r.inv_t), i); });
    }
}

// Argmax with the lowest id on ties.
struct Best {
    float v;
    uint32_t i;
};
__device__ Best better(Best a, Best b) { return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a; }

// Raw max (and its lowest id) with the sum of exp(x - max).
struct Softmax {
    Best top;
    float sum;
};
__device__ Softmax merge(Softmax a, Softmax b) {
    const float m = fmaxf(a.top.v, b.top.v);
    const float sa = a.top.v == m ? a.sum : a.sum * expf(a.top.v - m);
    const float sb = b.top.v == m ? b.sum : b.sum * expf(b.top.v - m);
    return {better(a.top, b.top), sa + sb};
}

__device__ Softmax shfl_xor(Softmax x, int o) {
    return {{__shfl_xor_sync(~0u, x.top.v, o), __shfl_xor_sync(~0u, x.top.i, o)}, __shfl_xor_sync(~0u, x.sum, o)};
}

__device__ Softmax block_softmax(Softmax x, Shared &sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) x = merge(x, shfl_xor(x, o));
    if (lane == 0) sh.red_v[warp] = x.top.v, sh.red_i[warp] = x.top.i, sh.red_sum[warp] = x.sum;
    __syncthreads();
    x = {{sh.red_v[lane], sh.red_i[lane]}, sh.red_sum[lane]};  // kWarps == 32 lanes
    for (int o = 16; o; o >>= 1) x = merge(x, shfl_xor(x, o));
    __syncthreads();
    return x;
}

__device__ Best block_best(Best x, Shared &sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) x = better(x, {__shfl_xor_sync(~0u, x.v, o), __shfl_xor_sync(~0u, x.i, o)});
    if (lane == 0) sh.red_v[warp] = x.v, sh.red_i[warp] = x.i;
    __syncthreads();
    x = {sh.red_v[lane], sh.red_i[lane]};
    for (int o = 16; o; o >>= 1) x = better(x, {__shfl_xor_sync(~0u, x.v, o), __shfl_xor_sync(~0u, x.i, o)});
    __syncthreads();
    return x;
}

// Histogram adds, merged while a thread's consecutive tokens fall in the same bin (near the
// top of a row most do), so a crowded bin costs few shared atomics.
struct BinRun {
    uint32_t bin = kNone, count = 0;
    unsigned long long mass = 0;
    __device__ void add(uint32_t b, unsigned long long q, Shared &sh) {
        if (b != bin) flush(sh), bin = b;
        count++, mass += q;
    }
    __device__ void flush(Shared &sh) {
        if (count) atomicAdd(&sh.count[bin], count);
        if (mass) {
            const uint32_t lo = static_cast<uint32_t>(mass), old = atomicAdd(&sh.mass_lo[bin], lo);
            const uint32_t hi = static_cast<uint32_t>(mass >> 32) + (old + lo < old);  // carry out of lo
            if (hi) atomicAdd(&sh.mass_hi[bin], hi);
        }
        count = 0, mass = 0;
    }
};

__device__ unsigned long long bin_mass(const Shared &sh, uint32_t b) {
    return static_cast<unsigned long long>(sh.mass_hi[b]) << 32 | sh.mass_lo[b];
}

// ---- a row's CTAs together ----
// Global scratch per row, zero between launches: the last barrier of a launch that used a
// histogram is followed by each CTA clearing its share of it. Launches on one device run one
// after another (one stream), as the decode loop issues them.
constexpr int kHistograms = 6;  // top_k's three radix levels, then top_p's three
struct RowScratch {
    uint32_t arrived, generation;  // row_sync: CTAs at the barrier, barriers passed
    float soft_v[kMaxSlices], soft_sum[kMaxSlices], best_v[kMaxSlices];
    uint32_t soft_i[kMaxSlices], best_i[kMaxSlices];
    // nucleus_keeps, per slice: top_p's mass, and that above the whole row's winner
    unsigned long long head_mass[kMaxSlices], head_above[kMaxSlices];
    uint32_t count[kHistograms][kBins];
    unsigned long long mass[3][kBins];  // top_p's levels
};
__device__ RowScratch g_rows[NMK_SAMPLE_MAX_ROWS];

struct Team {  // this CTA among its row's
    RowScratch *g;
    uint32_t slice, slices;
    uint32_t used;  // bit h: this launch added into histogram h
};

__device__ uint32_t load_acquire(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Every CTA of the row arrives before any leaves; what each wrote before is visible to all
// after (read it with __ldcg). The last to arrive resets the count and opens the barrier.
__device__ void row_sync(const Team &t) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t seen = load_acquire(&t.g->generation);
        __threadfence();
        if (atomicAdd(&t.g->arrived, 1u) == t.slices - 1) {
            atomicExch(&t.g->arrived, 0u);
            __threadfence();
            atomicAdd(&t.g->generation, 1u);
        } else {
            while (load_acquire(&t.g->generation) == seen) __nanosleep(32);
        }
        __threadfence();
    }
    __syncthreads();
}

// The row's histogram h from every CTA's (in shared memory), added in global memory with
// integer atomics (exact in any order), back into this CTA's shared histogram.
template <bool kWithMass>
__device__ void share_histogram(Shared &sh, Team &t, int h, uint32_t bins) {
    uint32_t *count = t.g->count[h];
    unsigned long long *mass = t.g->mass[kWithMass ? h - 3 : 0];
    for (uint32_t b = threadIdx.x; b < bins; b += kThreads) {
        if (sh.count[b]) atomicAdd(&count[b], sh.count[b]);
        if (kWithMass) {
            const unsigned long long m = bin_mass(sh, b);
            if (m) atomicAdd(&mass[b], m);
        }
    }
    t.used |= 1u << h;
    row_sync(t);
    for (uint32_t b = threadIdx.x; b < bins; b += kThreads) {
        sh.count[b] = __ldcg(&count[b]);
        if (kWithMass) {
            const unsigned long long m = __ldcg(&mass[b]);
            sh.mass_lo[b] = static_cast<uint32_t>(m), sh.mass_hi[b] = static_cast<uint32_t>(m >> 32);
        }
    }
    __syncthreads();
}

// After the launch's last barrier: this CTA's share of every histogram the row used, zeroed.
__device__ void clear_histograms(const Team &t) {
    const uint32_t lo = t.slice * kBins / t.slices, hi = (t.slice + 1) * kBins / t.slices;
    for (int h = 0; h < kHistograms; h++) {
        if (!(t.used >> h & 1)) continue;
        for (uint32_t b = lo + threadIdx.x; b < hi; b += kThreads) {
            t.g->count[h][b] = 0;
            if (h >= 3) t.g->mass[h - 3][b] = 0;
        }
    }
}

// The first pass's results: the raw max, its lowest id and sum exp, and the Gumbel winner of
// the tokens it scored (none: {-inf, kNone}).
struct FirstPass {
    Softmax raw;
    Best any;
};

// The row's FirstPass from each CTA's, merged in slice order (the winner only `with_any`).
__device__ FirstPass share_first_pass(FirstPass x, bool with_any, Shared &sh, const Team &t) {
    if (threadIdx.x == 0) {
        t.g->soft_v[t.slice] = x.raw.top.v, t.g->soft_i[t.slice] = x.raw.top.i, t.g->soft_sum[t.slice] = x.raw.sum;
        if (with_any) t.g->best_v[t.slice] = x.any.v, t.g->best_i[t.slice] = x.any.i;
    }
    row_sync(t);
    if (threadIdx.x == 0) {
        Softmax all{{-kInf, kNone}, 0.0f};
        for (uint32_t c = 0; c < t.slices; c++)
            all = merge(all, {{__ldcg(&t.g->soft_v[c]), __ldcg(&t.g->soft_i[c])}, __ldcg(&t.g->soft_sum[c])});
        sh.red_v[0] = all.top.v, sh.red_i[0] = all.top.i, sh.red_sum[0] = all.sum;
        if (with_any) {
            for (uint32_t c = 0; c < t.slices; c++) x.any = better(x.any, {__ldcg(&t.g->best_v[c]), __ldcg(&t.g->best_i[c])});
            sh.red_v[1] = x.any.v, sh.red_i[1] = x.any.i;
        }
    }
    __syncthreads();
    x.raw = {{sh.red_v[0], sh.red_i[0]}, sh.red_sum[0]};
    if (with_any) x.any = {sh.red_v[1], sh.red_i[1]};
    __syncthreads();
    return x;
}

// The row's Gumbel winner from each CTA's (thread 0's result).
__device__ Best share_best(Best x, const Team &t) {
    if (threadIdx.x == 0) t.g->best_v[t.slice] = x.v, t.g->best_i[t.slice] = x.i;
    row_sync(t);
    if (threadIdx.x == 0)
        for (uint32_t c = 0; c < t.slices; c++) x = better(x, {__ldcg(&t.g->best_v[c]), __ldcg(&t.g->best_i[c])});
    return x;
}

// Radix levels over the 32 key bits: digits of 11, 11 and 10 bits.
__device__ int level_shift(int level) { return level == 0 ? 21 : level == 1 ? 10 : 0; }
__device__ uint32_t level_bins(int level) { return level == 2 ? 1024u : 2048u; }

// One radix level's histogram over the candidates with key >= floor_key whose high bits are
// `prefix` (under `mask`): counts, and top_p masses when with_mass. With masses, tokens of no
// mass (s - max s < kMassCut) are left out: all mass lies above them, so top_p never keeps
// them and the search ends where it would with them. When collect_key is not kNone and there
// is no list yet, the counted candidates with key >= collect_key become the list.
template <bool kWithMass>
__device__ void histogram(const RowView &r, Shared &sh, Team &t, int h, int level, uint32_t prefix, uint32_t mask,
                          uint32_t floor_key, float max_s, uint32_t collect_key) {
    const int shift = level_shift(level);
    const uint32_t bins = level_bins(level);
    for (uint32_t b = threadIdx.x; b < bins; b += kThreads) sh.count[b] = 0, sh.mass_lo[b] = 0, sh.mass_hi[b] = 0;
    if (threadIdx.x == 0) sh.fill = 0;
    const bool collect = collect_key != kNone && sh.num_cand == kNone;
    __syncthreads();
    BinRun run;
    for_each_candidate(r, sh, [&](float s, uint32_t i) {
        const uint32_t key = order_key(s);
        const float d = __fsub_rn(s, max_s);
        if (key < floor_key || (kWithMass && !(d >= kMassCut))) return;
        if (collect && key >= collect_key) {
            const uint32_t c = atomicAdd(&sh.fill, 1u);
            sh.cand_s[c] = s, sh.cand_i[c] = i;
        }
        if ((key & mask) == prefix) run.add((key >> shift) & (bins - 1), kWithMass ? token_mass(d) : 0, sh);
    });
    run.flush(sh);
    __syncthreads();
    if (collect && threadIdx.x == 0) sh.num_cand = sh.fill;  // read after the caller's next barrier
    if (t.slices > 1) share_histogram<kWithMass>(sh, t, h, bins);
}

// Inclusive sum over lanes >= this one.
template <class T>
__device__ T suffix_sum(T v) {
    const int lane = threadIdx.x & 31;
    for (int o = 1; o < 32; o <<= 1) {
        const T w = __shfl_down_sync(~0u, v, o);
        if (lane + o < 32) v += w;
    }
    return v;
}

// The list bound after a level: its bin's lower edge, when few enough tokens lie at or above it.
__device__ uint32_t collect_bound(const Shared &sh, uint32_t prefix) {
    return sh.at_or_above <= kCandidates ? prefix : kNone;
}

// The key of the k-th largest scaled logit (1 <= k < vocab).
__device__ uint32_t top_k_key(const RowView &r, uint32_t k, Shared &sh, Team &t) {
    uint32_t prefix = 0, mask = 0, collect_key = kNone;
    for (int level = 0; level < 3; level++) {
        const int shift = level_shift(level);
        const uint32_t bins = level_bins(level);
        histogram<false>(r, sh, t, level, level, prefix, mask, 0, 0.0f, collect_key);
        if (threadIdx.x < 32) {  // the bin holding rank k, counting from the top
            const uint32_t per = bins / 32, lo = threadIdx.x * per;
            uint32_t total = 0;
            for (uint32_t j = 0; j < per; j++) total += sh.count[lo + j];
            uint32_t above = suffix_sum(total) - total;
            if (above < k && k <= above + total) {
                for (uint32_t d = lo + per; d-- > lo; above += sh.count[d])
                    if (above + sh.count[d] >= k) {
                        sh.digit = d, sh.rank = k - above, sh.at_or_above = above + sh.count[d];
                        break;
                    }
            }
        }
        __syncthreads();
        prefix |= sh.digit << shift, mask |= (bins - 1) << shift, k = sh.rank;
        if (level == 0) collect_key = collect_bound(sh, prefix);
    }
    return prefix;
}

// ceil(top_p * z), exactly: top_p = mant * 2^-shr.
__device__ unsigned long long nucleus_limit(unsigned long long z, float top_p) {
    const uint32_t bits = __float_as_uint(top_p), biased = bits >> 23;
    const uint32_t mant = biased ? (bits & 0x007fffffu) | 0x00800000u : bits & 0x007fffffu;
    const int shr = biased ? 150 - static_cast<int>(biased) : 149;
    const unsigned __int128 prod = static_cast<unsigned __int128>(z) * mant;
    return shr >= 100 ? (prod != 0)
                      : static_cast<unsigned long long>((prod + ((static_cast<unsigned __int128>(1) << shr) - 1)) >> shr);
}

// The key of the smallest kept value v (key >= floor_key) such that the mass of kept tokens
// above v is below ceil(top_p * Z), Z the kept mass; the max when Z is 0.
__device__ uint32_t top_p_key(const RowView &r, float max_s, uint32_t floor_key, float top_p, Shared &sh,
                            Team &t) {
    uint32_t prefix = 0, mask = 0, collect_key = kNone;
    if (threadIdx.x == 0) sh.base = 0;
    for (int level = 0; level < 3; level++) {
        const int shift = level_shift(level);
        const uint32_t bins = level_bins(level);
        histogram<true>(r, sh, t, 3 + level, level, prefix, mask, floor_key, max_s, collect_key);
        if (threadIdx.x < 32) {
            const uint32_t per = bins / 32, lo = threadIdx.x * per;
            unsigned long long total = 0;
            uint32_t tokens = 0;
            for (uint32_t j = 0; j < per; j++) total += bin_mass(sh, lo + j), tokens += sh.count[lo + j];
            const unsigned long long incl = suffix_sum(total);
            if (level == 0) {
                const unsigned long long z = __shfl_sync(~0u, incl, 0);
                if (threadIdx.x == 0) sh.limit = nucleus_limit(z, top_p);
            }
            __syncwarp();
            unsigned long long above = sh.base + (incl - total), at = 0;
            uint32_t held = suffix_sum(tokens) - tokens, found = kNone, found_held = 0;
            // this lane's lowest nonempty bin with less than limit above it
            for (uint32_t d = lo + per; d-- > lo; above += bin_mass(sh, d)) {
                held += sh.count[d];
                if (sh.count[d] && above < sh.limit) found = d, at = above, found_held = held;
            }
            uint32_t lowest = found;
            for (int o = 16; o; o >>= 1) lowest = min(lowest, __shfl_xor_sync(~0u, lowest, o));
            __syncwarp();  // every lane has read sh.base (above) before one of them rewrites it
            if (found == lowest && found != kNone) sh.digit = found, sh.base = at, sh.at_or_above = found_held;
        }
        __syncthreads();
        if (level == 0 && sh.limit == 0) return order_key(max_s);  // no mass at all: keep the top value
        prefix |= sh.digit << shift, mask |= (bins - 1) << shift;
        if (level == 0) collect_key = collect_bound(sh, prefix);
    }
    return prefix;
}

// Offers token i (scaled logit s, kept) to the running Gumbel argmax. A token whose best
// possible score is below the leader's is skipped unhashed; one whose estimated score (__logf:
// within 4e-4 of the exact noise while -log u > 1e-3) is clearly below is skipped unrounded.
__device__ void offer(Best &win, float s, uint32_t i, uint64_t key) {
    if (__fadd_rn(s, kMaxGumbel) < win.v) return;
    const float u = uniform(key, i), e = -__logf(u);
    if (e > 1e-3f && s - __logf(e) < win.v - (1e-3f + 1e-6f * fabsf(win.v))) return;
    win = better(win, {__fadd_rn(s, gumbel(u)), i});
}

// Whether top_p keeps the token of scaled logit s_w (no top_k: top_p's mass would then be that
// of top_k's survivors): less than ceil(top_p * Z) of the row's top_p mass Z lies above it, Z >
// 0 (top_p_key keeps the max alone when Z is 0). One pass over the slice and, for a sliced
// row, one barrier.
__device__ bool nucleus_keeps(const RowView &r, float max_s, float s_w, float top_p, Shared &sh, const Team &t) {
    const uint32_t kw = order_key(s_w);
    unsigned long long mass = 0, above = 0;
    for_each_logit(r.logits, r.vocab, r.lo, r.hi, [&](float x, uint32_t) {
        const float s = scaled(x, r.inv_t);
        const unsigned long long q = token_mass(__fsub_rn(s, max_s));
        mass += q, above += order_key(s) > kw ? q : 0;
    });
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) mass += __shfl_xor_sync(~0u, mass, o), above += __shfl_xor_sync(~0u, above, o);
    if (lane == 0) sh.red_mass[warp] = mass, sh.red_above[warp] = above;
    __syncthreads();
    if (threadIdx.x == 0) {
        mass = 0, above = 0;
        for (int w = 0; w < kWarps; w++) mass += sh.red_mass[w], above += sh.red_above[w];
        if (t.slices > 1) t.g->head_mass[t.slice] = mass, t.g->head_above[t.slice] = above;
    }
    if (t.slices > 1) {
        row_sync(t);
        if (threadIdx.x == 0) {
            mass = 0, above = 0;  // integers: exact in any order
            for (uint32_t c = 0; c < t.slices; c++) mass += __ldcg(&t.g->head_mass[c]), above += __ldcg(&t.g->head_above[c]);
        }
    }
    if (threadIdx.x == 0) sh.head_kept = mass > 0 && above < nucleus_limit(mass, top_p);
    __syncthreads();
    const bool kept = sh.head_kept != 0;
    __syncthreads();  // every thread has read it (and thread 0 the warps' sums) before they are reused
    return kept;
}

// The first pass over this CTA's slice: the raw max, its lowest id and sum exp(x - max)
// (online; hardware exp: the logprob only), and with kWhole the Gumbel winner of every token.
template <bool kWhole>
__device__ FirstPass first_pass(const RowView &r, uint64_t key, Shared &sh) {
    float m = -kInf, sum = 0.0f;
    uint32_t arg = kNone;
    Best any{-kInf, kNone};
    for_each_logit(r.logits, r.vocab, r.lo, r.hi, [&](float x, uint32_t i) {
        if (kWhole) offer(any, scaled(x, r.inv_t), i, key);
        x = isnan(x) ? -kInf : x;
        if (x > m) {
            sum = sum * __expf(m - x) + 1.0f, m = x, arg = i;
        } else {
            if (arg == kNone) arg = i;
            if (x != -kInf) sum += __expf(x - m);
        }
    });
    if (kWhole) any = block_best(any, sh);
    return {block_softmax({{m, arg}, sum}, sh), any};
}

struct Args {
    const float *logits;  // [rows, vocab]
    uint32_t vocab;
    uint32_t slices;      // CTAs per row: CTA b draws row b / slices on slice b % slices
    int32_t *tokens;      // [rows]
    float *logprobs;      // [rows] or NULL
    nmk_sample_row rows[NMK_SAMPLE_MAX_ROWS];
};

// A row the kernel draws the whole-row Gumbel winner for: sampled, with top_p and without
// top_k (the kernel's rule, and the host's for which kernel to launch).
__host__ __device__ inline bool whole_row_winner(const nmk_sample_row &p, uint32_t vocab) {
    return p.temperature > 0.0f && p.top_p < 1.0f && (p.top_k <= 0 || static_cast<uint32_t>(p.top_k) >= vocab);
}

// kNucleus: the whole row's winner for top_p rows without top_k (the host launches it when the
// draw has such a row). Without it the kernel has none of that code: the other draws, which
// would not use it, ran ~3.5 us slower in a kernel that had it (benchmarks/NOTES.md).
template <bool kNucleus>
__global__ void __launch_bounds__(kThreads, 1) nmk_sample_kernel(const __grid_constant__ Args a) {
    __shared__ Shared sh;
    const uint32_t b = blockIdx.x / a.slices;
    Team t{&g_rows[b], blockIdx.x % a.slices, a.slices, 0u};
    const nmk_sample_row &p = a.rows[b];
    const float *row = a.logits + static_cast<size_t>(b) * a.vocab;
    const uint32_t chunk = ((a.vocab + a.slices - 1) / a.slices + 3) & ~3u;  // whole float4s
    const uint32_t lo = min(a.vocab, t.slice * chunk), hi = min(a.vocab, lo + chunk);
    if (threadIdx.x == 0) sh.num_cand = kNone;

    const bool sampled = p.temperature > 0.0f;
    const RowView r{row, a.vocab, lo, hi, sampled ? __frcp_rn(p.temperature) : 1.0f};
    const uint32_t top_k = p.top_k > 0 && static_cast<uint32_t>(p.top_k) < a.vocab ? p.top_k : 0;
    const uint64_t key = splitmix64(p.seed ^ splitmix64(p.counter));
    // The whole row's Gumbel winner, drawn in the first pass.
    const bool whole = kNucleus && whole_row_winner(p, a.vocab);
    FirstPass first = whole ? first_pass<true>(r, key, sh) : first_pass<false>(r, key, sh);
    if (t.slices > 1) first = share_first_pass(first, whole, sh, t);
    const Softmax raw = first.raw;
    const Best any = first.any;
    uint32_t token = raw.top.i;

    if (sampled) {
        const float max_s = scaled(raw.top.v, r.inv_t);
        const float min_p_cut = p.min_p > 0.0f ? __fadd_rn(max_s, det_log(p.min_p)) : -kInf;
        bool drawn = false;
        if (whole) {  // the winner's scaled logit against min_p and top_p
            const float s_w = scaled(__ldcg(row + any.i), r.inv_t);
            drawn = s_w >= min_p_cut && nucleus_keeps(r, max_s, s_w, p.top_p, sh, t);
            token = any.i;
        }
        if (!drawn) {
            float cut = -kInf;  // kept: scaled logit >= cut
            if (top_k) cut = key_value(top_k_key(r, top_k, sh, t));
            if (p.top_p < 1.0f) cut = fmaxf(cut, key_value(top_p_key(r, max_s, order_key(cut), p.top_p, sh, t)));
            cut = fmaxf(cut, min_p_cut);

            // The raw argmax is kept; its score is the first bound on the winner's.
            Best win{__fadd_rn(max_s, gumbel(uniform(key, raw.top.i))), raw.top.i};
            for_each_candidate(r, sh, [&](float s, uint32_t i) {
                if (s >= cut) offer(win, s, i, key);
            });
            win = block_best(win, sh);
            if (t.slices > 1) {
                win = share_best(win, t);
                clear_histograms(t);  // every CTA of the row has read them: past the last barrier
            }
            token = win.i;
        }
    }
    if (threadIdx.x == 0 && t.slice == 0) {
        a.tokens[b] = static_cast<int32_t>(token);
        if (a.logprobs) {
            const float x = row[token];
            a.logprobs[b] = (isnan(x) ? -kInf : x) - raw.top.v - logf(raw.sum);
        }
    }
}

// CTAs per row: as many as the SMs hold for all rows at once (so that a row's CTAs, which
// wait for each other, are all resident), at most kMaxSlices, at least kMinSlice logits each.
uint32_t slices_for(uint32_t rows, uint32_t vocab) {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        throw nmk::Error(NMK_ERR_CUDA, "nmk_sample: cannot read the device's SM count");
    const uint32_t by_sms = static_cast<uint32_t>(sms) / rows, by_vocab = (vocab + kMinSlice - 1) / kMinSlice;
    return std::max(1u, std::min({by_sms, by_vocab, kMaxSlices}));
}

void cuda_check(cudaError_t e, const char *what) {
    if (e != cudaSuccess) throw nmk::Error(NMK_ERR_CUDA, std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace
}  // namespace nmk::sample

extern "C" {

NMK_API nmk_status nmk_sample(const float *logits, uint32_t rows, uint32_t vocab, const nmk_sample_row *params,
                              int32_t *tokens, float *logprobs, void *stream) {
    nmk_status status = nmk::sample::check_args(logits, rows, vocab, params, tokens);
    if (status != NMK_OK) return status;
    return nmk::guard("nmk_sample", [&] {
        using namespace nmk::sample;
        Args a{logits, vocab, slices_for(rows, vocab), tokens, logprobs, {}};
        std::memcpy(a.rows, params, rows * sizeof(nmk_sample_row));
        const bool nucleus =
            std::any_of(params, params + rows, [&](const nmk_sample_row &p) { return whole_row_winner(p, vocab); });
        auto kernel = nucleus ? nmk_sample_kernel<true> : nmk_sample_kernel<false>;
        kernel<<<rows * a.slices, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
        cuda_check(cudaGetLastError(), "sampling kernel launch");
        return NMK_OK;
    });
}

}  // extern "C"
