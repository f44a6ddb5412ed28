/* The native engine's CPU kernels, called through ctypes from cpu_kernels.py, which compiles
   this file on first use (see that module's docstring for the flags and the cache).

   Every exported function here has a ctypes signature declared in cpu_kernels._load: change
   both together. The build always passes -Wall -Wextra, and the file compiles without a warning
   under each of cpu_kernels' flag sets, with or without OpenMP and AVX2: keep it so. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* OpenMP directives, compiled away when OpenMP is off (the last flag set cpu_kernels tries),
   where a bare "#pragma omp" would be ignored anyway but warn under -Wall. */
#ifdef _OPENMP
#define POLYRL_OMP(directive) _Pragma(directive)
#else
#define POLYRL_OMP(directive)
#endif

/* Ask for one cache block's keys (into L1) and values (into L2) ahead of use. A decode step
   reads every running sequence's whole cache once, block by block; blocks lie anywhere in the
   pool and one block is one 4 KiB page at common sizes (16 tokens x 2 kv heads x 32 floats),
   where hardware prefetchers stop, so without this every block starts with a run of cache
   misses. The values are only read after all keys (two-pass softmax), hence L2 for them. */
static inline void prefetch_block(const float *k, const float *v, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) {
        __builtin_prefetch(k + i, 0, 3);
        __builtin_prefetch(v + i, 0, 2);
    }
}

/* Attention of one query token per sequence over its paged keys and values.
   q: (B, H, D) rows q_sb floats apart; k_cache, v_cache: (blocks, BS, KVH, D) contiguous;
   table: (B, >= ceil(len/BS)) block ids, rows table_sb apart; kv_lens: (B,) keys to attend
   (the query sits at position kv_lens[b] - 1); out: (B, H, D) contiguous.
   window > 0 keeps only the last `window` keys (sliding-window attention).
   Query head h reads kv head h / G (grouped-query attention); each cached row is read once
   for all the heads that share it.

   decode_one does one sequence. It is inlined into callers with constant D and BS, so the
   inner loops compile to fixed-length vector code (about 30% faster than runtime sizes). */
static inline __attribute__((always_inline)) int decode_one(
    const float *qb, const float *k_cache, const float *v_cache, const int64_t *tb, int64_t len,
    float *ob, const int64_t H, const int64_t KVH, const int64_t D, const int64_t BS,
    float scale, int64_t window) {
    const int64_t G = H / KVH;
    const int64_t RD = KVH * D;
    const int64_t start = (window > 0 && len > window) ? len - window : 0;
    const int64_t n = len - start;
    float *s = (float *)malloc(sizeof(float) * (size_t)(H * n + H * D + 2 * H));
    if (s == NULL) return -1;
    float *acc = s + H * n;
    float *mx = acc + H * D;
    float *sum = mx + H;
    for (int64_t h = 0; h < H; h++) { mx[h] = -INFINITY; sum[h] = 0.f; }
    const int64_t nblk = (len + BS - 1) / BS;
    for (int64_t l = start; l < len;) {
        const int64_t blk = l / BS, off = l - blk * BS;
        const int64_t cnt = (BS - off < len - l) ? BS - off : len - l;
        const float *kb = k_cache + (tb[blk] * BS + off) * RD;
        if (blk + 1 < nblk)
            prefetch_block(k_cache + tb[blk + 1] * BS * RD, v_cache + tb[blk + 1] * BS * RD,
                           BS * RD);
        for (int64_t t = 0; t < cnt; t++) {
            const int64_t i = l - start + t;
            for (int64_t kh = 0; kh < KVH; kh++) {
                const float *kv = kb + t * RD + kh * D;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t h = kh * G + g;
                    const float *qh = qb + h * D;
                    float dot = 0.f;
                    POLYRL_OMP("omp simd reduction(+ : dot)")
                    for (int64_t d = 0; d < D; d++) dot += qh[d] * kv[d];
                    dot *= scale;
                    s[h * n + i] = dot;
                    mx[h] = dot > mx[h] ? dot : mx[h];
                }
            }
        }
        l += cnt;
    }
    for (int64_t h = 0; h < H; h++) {
        float *sh = s + h * n;
        const float m = mx[h];
        float total = 0.f;
        for (int64_t i = 0; i < n; i++) { const float e = expf(sh[i] - m); sh[i] = e; total += e; }
        sum[h] = total;
    }
    for (int64_t i = 0; i < H * D; i++) acc[i] = 0.f;
    for (int64_t l = start; l < len;) {
        const int64_t blk = l / BS, off = l - blk * BS;
        const int64_t cnt = (BS - off < len - l) ? BS - off : len - l;
        const float *vb = v_cache + (tb[blk] * BS + off) * RD;
        for (int64_t t = 0; t < cnt; t++) {
            const int64_t i = l - start + t;
            for (int64_t kh = 0; kh < KVH; kh++) {
                const float *vv = vb + t * RD + kh * D;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t h = kh * G + g;
                    const float p = s[h * n + i];
                    float *ah = acc + h * D;
                    POLYRL_OMP("omp simd")
                    for (int64_t d = 0; d < D; d++) ah[d] += p * vv[d];
                }
            }
        }
        l += cnt;
    }
    for (int64_t h = 0; h < H; h++) {
        const float inv = 1.f / sum[h];
        for (int64_t d = 0; d < D; d++) ob[h * D + d] = acc[h * D + d] * inv;
    }
    free(s);
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define POLYRL_AVX2 1

/* The 8 horizontal sums of v0..v7, as one vector (lane j = sum of vj's lanes). */
static inline __m256 polyrl_sum8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4,
                                 __m256 v5, __m256 v6, __m256 v7) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v4, v5), _mm256_hadd_ps(v6, v7));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* exp of 8 floats (glibc's expf is a scalar call, and was a large part of a decode step's
   attention time). Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, then a degree-7 Taylor
   polynomial: relative error ~1e-7, i.e. float32 rounding. Inputs are clamped to [-87, 88]
   (results below 1.7e-38 are negligible next to a softmax maximum's weight of 1). */
static inline __m256 polyrl_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.98412698e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.38888889e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33333333e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16666667e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666667e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* decode_one with AVX2/FMA (D a multiple of 8): the scores of 8 keys at a time share one
   transposing reduction instead of 8 scalar ones, and each head's output accumulates in
   registers over all its values. Same math as decode_one (float32, max-subtracted softmax).

   next_tb / next_len describe the sequence this thread attends next (next_tb NULL: none or
   unknown). Its key blocks are prefetched into L2 during this sequence's value pass: the key
   pass streams from memory (bandwidth bound) while the value pass computes on values already
   in L2 and leaves the memory bus idle, so spreading the next keys' fetch over it overlaps the
   two (attention 15-20% faster in a decode-step-shaped microbenchmark). Reading each value
   once for all heads that share it (instead of once per head) was tried with this and was
   slower: the shorter value pass leaves less time to hide the next keys' fetch. */
static inline __attribute__((always_inline)) int decode_one_avx2(
    const float *qb, const float *k_cache, const float *v_cache, const int64_t *tb, int64_t len,
    float *ob, const int64_t H, const int64_t KVH, const int64_t D, const int64_t BS,
    float scale, int64_t window, const int64_t *next_tb, int64_t next_len) {
    const int64_t G = H / KVH;
    const int64_t RD = KVH * D;
    const int64_t NC = D / 8;
    const int64_t start = (window > 0 && len > window) ? len - window : 0;
    const int64_t n = len - start;
    /* Next sequence's key blocks still to prefetch: [next_pf, next_nblk), from its first
       attended block, skipping block 0, which the caller's loop prefetches already. */
    const int64_t next_nblk = next_tb == NULL ? 0 : (next_len + BS - 1) / BS;
    int64_t next_pf = (window > 0 && next_len > window) ? (next_len - window) / BS : 1;
    float *s = (float *)malloc(sizeof(float) * (size_t)(H * n));
    if (s == NULL) return -1;
    const __m256 vscale = _mm256_set1_ps(scale);
    const int64_t nblk = (len + BS - 1) / BS;
    for (int64_t l = start; l < len;) {
        const int64_t blk = l / BS, off = l - blk * BS;
        const int64_t cnt = (BS - off < len - l) ? BS - off : len - l;
        const float *kb = k_cache + (tb[blk] * BS + off) * RD;
        if (blk + 1 < nblk)
            prefetch_block(k_cache + tb[blk + 1] * BS * RD, v_cache + tb[blk + 1] * BS * RD,
                           BS * RD);
        int64_t t = 0;
        for (; t + 8 <= cnt; t += 8) {
            const int64_t i = l - start + t;
            for (int64_t h = 0; h < H; h++) {
                const float *kh = kb + t * RD + (h / G) * D;
                const float *qh = qb + h * D;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0,
                       a6 = a0, a7 = a0;
                for (int64_t c = 0; c < NC; c++) {
                    const __m256 qv = _mm256_loadu_ps(qh + 8 * c);
                    const float *kc = kh + 8 * c;
                    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc), a0);
                    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + RD), a1);
                    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + 2 * RD), a2);
                    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + 3 * RD), a3);
                    a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + 4 * RD), a4);
                    a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + 5 * RD), a5);
                    a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + 6 * RD), a6);
                    a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + 7 * RD), a7);
                }
                const __m256 dots = polyrl_sum8(a0, a1, a2, a3, a4, a5, a6, a7);
                _mm256_storeu_ps(s + h * n + i, _mm256_mul_ps(dots, vscale));
            }
        }
        for (; t < cnt; t++) {
            const int64_t i = l - start + t;
            for (int64_t h = 0; h < H; h++) {
                const float *kh = kb + t * RD + (h / G) * D;
                const float *qh = qb + h * D;
                __m256 a = _mm256_setzero_ps();
                for (int64_t c = 0; c < NC; c++)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), _mm256_loadu_ps(kh + 8 * c),
                                        a);
                __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
                r = _mm_add_ps(r, _mm_movehl_ps(r, r));
                r = _mm_add_ss(r, _mm_movehdup_ps(r));
                s[h * n + i] = _mm_cvtss_f32(r) * scale;
            }
        }
        l += cnt;
    }
    for (int64_t h = 0; h < H; h++) {
        float *sh = s + h * n;
        float m = -INFINITY;
        POLYRL_OMP("omp simd reduction(max : m)")
        for (int64_t i = 0; i < n; i++) m = sh[i] > m ? sh[i] : m;
        float total = 0.f;
        int64_t i = 0;
        __m256 vtotal = _mm256_setzero_ps();
        const __m256 vm = _mm256_set1_ps(m);
        for (; i + 8 <= n; i += 8) {
            const __m256 e = polyrl_exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + i), vm));
            _mm256_storeu_ps(sh + i, e);
            vtotal = _mm256_add_ps(vtotal, e);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, vtotal);
        for (int64_t j = 0; j < 8; j++) total += lanes[j];
        for (; i < n; i++) { const float e = expf(sh[i] - m); sh[i] = e; total += e; }
        const float *vh0 = v_cache + (h / G) * D;
        __m256 acc[16];
        for (int64_t c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t l = start; l < len;) {
            const int64_t blk = l / BS, off = l - blk * BS;
            const int64_t cnt = (BS - off < len - l) ? BS - off : len - l;
            const float *vb = vh0 + (tb[blk] * BS + off) * RD;
            const float *ph = sh + (l - start);
            if (next_pf < next_nblk) { /* one next key block per value block: spread out */
                const float *nk = k_cache + next_tb[next_pf] * BS * RD;
                for (int64_t i = 0; i < BS * RD; i += 16) __builtin_prefetch(nk + i, 0, 2);
                next_pf++;
            }
            for (int64_t t = 0; t < cnt; t++) {
                const __m256 p = _mm256_set1_ps(ph[t]);
                const float *vv = vb + t * RD;
                for (int64_t c = 0; c < NC; c++)
                    acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vv + 8 * c), acc[c]);
            }
            l += cnt;
        }
        const __m256 inv = _mm256_set1_ps(1.f / total);
        for (int64_t c = 0; c < NC; c++)
            _mm256_storeu_ps(ob + h * D + 8 * c, _mm256_mul_ps(acc[c], inv));
    }
    free(s);
    return 0;
}

#define DECODE_LOOP_AVX2(DV, BSV)                                                            \
    POLYRL_OMP("omp parallel for num_threads(nthreads) schedule(dynamic, 1)")               \
    for (int64_t b = 0; b < B; b++) {                                                        \
        if (b + 1 < B) {                                                                 \
            const int64_t first = table[(b + 1) * table_sb] * (BSV) * KVH * (DV);        \
            prefetch_block(k_cache + first, v_cache + first, (BSV) * KVH * (DV));        \
        }                                                                                \
        /* With one thread, sequence b + 1 is this thread's next (see decode_one_avx2). */ \
        const int next = nthreads == 1 && b + 1 < B;                                         \
        if (decode_one_avx2(q + b * q_sb, k_cache, v_cache, table + b * table_sb,            \
                            kv_lens[b], out + b * H * (DV), H, KVH, DV, BSV, scale, window,  \
                            next ? table + (b + 1) * table_sb : NULL,                        \
                            next ? kv_lens[b + 1] : 0) != 0)                                 \
            failed = 1;                                                                      \
    }
#endif

/* SiLU(gate) * up, elementwise over n floats (the gated MLP's middle): one pass instead of
   two torch ops and a temporary. Compute bound (~3 cycles a float: the exponential and a
   division), so a decode step's 128 x 512 floats (~50 us on one core) are split over the
   threads; each float is computed the same way whichever thread takes it. */
void polyrl_silu_mul_f32(const float *gate, const float *up, float *out, int64_t n,
                         int nthreads) {
    (void)nthreads; /* unused without OpenMP */
    const int64_t chunk = 4096;
    const int64_t chunks = (n + chunk - 1) / chunk;
    POLYRL_OMP("omp parallel for num_threads(nthreads) schedule(static) if (chunks >= 8)")
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t hi = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        int64_t i = c * chunk;
#ifdef POLYRL_AVX2
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= hi; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 e = polyrl_exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < hi; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

#define DECODE_LOOP(DV, BSV)                                                                 \
    POLYRL_OMP("omp parallel for num_threads(nthreads) schedule(dynamic, 1)")               \
    for (int64_t b = 0; b < B; b++) {                                                        \
        if (b + 1 < B) {                                                                 \
            const int64_t first = table[(b + 1) * table_sb] * (BSV) * KVH * (DV);        \
            prefetch_block(k_cache + first, v_cache + first, (BSV) * KVH * (DV));        \
        }                                                                                \
        if (decode_one(q + b * q_sb, k_cache, v_cache, table + b * table_sb, kv_lens[b],     \
                       out + b * H * (DV), H, KVH, DV, BSV, scale, window) != 0)             \
            failed = 1;                                                                      \
    }

/* Rotary embedding of a packed step's queries and keys (in place, HF "rotate_half" layout:
   x' = x * cos + rotate_half(x) * sin), then the rotated keys and the values are stored at
   their cache slots. q: (T, H, D), k, v: (T, KVH, D) contiguous; cos, sin: (T, D)
   contiguous; slots: (T,); k_cache, v_cache: (slots, KVH, D) contiguous. One call replaces
   about a dozen small torch ops per layer. Returns -1 (nothing written) on a slot outside
   [0, num_slots). */
static inline void rope_row(float *x, const float *c, const float *sn, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * sn[i];
        x[i + half] = b * c[i + half] + a * sn[i + half];
    }
}

int polyrl_rope_store_f32(float *q, float *k, const float *v, const float *cos_t,
                          const float *sin_t, const int64_t *slots, float *k_cache,
                          float *v_cache, int64_t num_slots, int64_t T, int64_t H, int64_t KVH,
                          int64_t D, int nthreads) {
    (void)nthreads; /* unused without OpenMP */
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1; /* never write out of bounds */
    POLYRL_OMP("omp parallel for num_threads(nthreads) schedule(static) if (T > 64)")
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + t * D, *sn = sin_t + t * D;
        for (int64_t h = 0; h < H; h++) rope_row(q + (t * H + h) * D, c, sn, D);
        float *kt = k + t * KVH * D;
        for (int64_t h = 0; h < KVH; h++) rope_row(kt + h * D, c, sn, D);
        memcpy(k_cache + slots[t] * KVH * D, kt, sizeof(float) * (size_t)(KVH * D));
        memcpy(v_cache + slots[t] * KVH * D, v + t * KVH * D, sizeof(float) * (size_t)(KVH * D));
    }
    return 0;
}

/* Residual add and RMSNorm of each row: h += delta (when delta is not NULL), then
   out = h / sqrt(mean(h^2) + eps) * w. h, delta, out: (T, N) contiguous; w: (N,). torch's
   CPU rms_norm is a chain of ops costing ~35 us even for one row; this is one call. */
void polyrl_add_rms_norm_f32(float *h, const float *delta, const float *w, float *out,
                             int64_t T, int64_t N, float eps, int nthreads) {
    (void)nthreads; /* unused without OpenMP */
    POLYRL_OMP("omp parallel for num_threads(nthreads) schedule(static) if (T > 64)")
    for (int64_t t = 0; t < T; t++) {
        float *ht = h + t * N;
        if (delta != NULL) {
            const float *dt = delta + t * N;
            for (int64_t i = 0; i < N; i++) ht[i] += dt[i];
        }
        /* Eight partial sums: one running sum is a chain of dependent adds (~4 cycles
           each), which made this kernel latency bound; eight vectorise and overlap. */
        double part[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
        int64_t i0 = 0;
        for (; i0 + 8 <= N; i0 += 8)
            for (int64_t j = 0; j < 8; j++) part[j] += (double)ht[i0 + j] * (double)ht[i0 + j];
        double ss = ((part[0] + part[4]) + (part[1] + part[5])) +
                    ((part[2] + part[6]) + (part[3] + part[7]));
        for (; i0 < N; i0++) ss += (double)ht[i0] * (double)ht[i0];
        const float inv = (float)(1.0 / sqrt(ss / (double)N + (double)eps));
        float *ot = out + t * N;
        for (int64_t i = 0; i < N; i++) ot[i] = w[i] * (ht[i] * inv);
    }
}

/* Sampling by inversion, one token per row. p: (R, V) probabilities (softmax of z), z: the
   (R, V) logits they came from (-inf = masked), u: (R,) uniforms; all contiguous. The
   cumulative sums are formed exactly as torch's CPU cumsum forms them (a double running sum
   rounded to float at each entry), so the token is the one the torch path picks: the first
   entry whose cumulative sum exceeds u * total (searchsorted, right=True), at most V - 1; if
   that entry is masked (a target rounded up to the total), the first entry whose cumulative
   sum reaches the total. One pass instead of five torch ops and their temporaries.

   A row's running sum is one chain of dependent adds (latency bound), so four rows are summed
   side by side into a scratch copy of their cumulative sums; those never decrease, so both
   searches are binary searches over it. Returns -1 when the scratch cannot be allocated. */
/* First i with cum[i] > x (reach = 0) or cum[i] >= x (reach = 1), or V. */
static int64_t first_index(const float *cum, int64_t V, float x, int reach) {
    int64_t lo = 0, hi = V;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (cum[mid] > x || (reach && cum[mid] == x)) hi = mid; else lo = mid + 1;
    }
    return lo;
}

int polyrl_inverse_sample_f32(const float *p, const float *z, const float *u, int64_t *out,
                              int64_t R, int64_t V) {
    float *cum = (float *)malloc(sizeof(float) * (size_t)(4 * V));
    if (cum == NULL) return -1;
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
        /* Rows past the end repeat row r0 (computed, not used). */
        const float *p0 = p + r0 * V;
        const float *p1 = r0 + 1 < R ? p0 + V : p0;
        const float *p2 = r0 + 2 < R ? p0 + 2 * V : p0;
        const float *p3 = r0 + 3 < R ? p0 + 3 * V : p0;
        float *c0 = cum, *c1 = cum + V, *c2 = cum + 2 * V, *c3 = cum + 3 * V;
        double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
        for (int64_t i = 0; i < V; i++) {
            a0 += (double)p0[i];
            a1 += (double)p1[i];
            a2 += (double)p2[i];
            a3 += (double)p3[i];
            c0[i] = (float)a0;
            c1[i] = (float)a1;
            c2[i] = (float)a2;
            c3[i] = (float)a3;
        }
        for (int64_t j = 0; j < 4 && r0 + j < R; j++) {
            const int64_t r = r0 + j;
            const float *c = cum + j * V;
            const float total = c[V - 1];
            int64_t idx = first_index(c, V, u[r] * total, 0);
            if (idx > V - 1) idx = V - 1;
            if (z[r * V + idx] == -INFINITY) {
                const int64_t below = first_index(c, V, total, 1);
                idx = below < V - 1 ? below : V - 1;
            }
            out[r] = idx;
        }
    }
    free(cum);
    return 0;
}

/* Returns 0; -1 when scratch memory could not be allocated; -2 (nothing computed) when a
   block id the lengths reach lies outside [0, num_blocks), or a length is not positive. */
int polyrl_paged_decode_f32(const float *q, int64_t q_sb, const float *k_cache,
                            const float *v_cache, const int64_t *table, int64_t table_sb,
                            const int64_t *kv_lens, float *out, int64_t B, int64_t H,
                            int64_t KVH, int64_t D, int64_t BS, int64_t num_blocks,
                            float scale, int64_t window, int nthreads) {
    (void)nthreads; /* unused without OpenMP or AVX2 */
    int failed = 0;
    for (int64_t b = 0; b < B; b++) {
        if (kv_lens[b] <= 0 || (kv_lens[b] + BS - 1) / BS > table_sb) return -2;
        for (int64_t i = 0; i < (kv_lens[b] + BS - 1) / BS; i++) {
            const int64_t blk = table[b * table_sb + i];
            if (blk < 0 || blk >= num_blocks) return -2;
        }
    }
#ifdef POLYRL_AVX2
    if (BS == 16 && D == 32) { DECODE_LOOP_AVX2(32, 16) }
    else if (BS == 16 && D == 64) { DECODE_LOOP_AVX2(64, 16) }
    else if (BS == 16 && D == 128) { DECODE_LOOP_AVX2(128, 16) }
    else if (D % 8 == 0 && D <= 128) { DECODE_LOOP_AVX2(D, BS) }
    else { DECODE_LOOP(D, BS) }
#else
    if (BS == 16 && D == 32) { DECODE_LOOP(32, 16) }
    else if (BS == 16 && D == 64) { DECODE_LOOP(64, 16) }
    else if (BS == 16 && D == 128) { DECODE_LOOP(128, 16) }
    else { DECODE_LOOP(D, BS) }
#endif
    return failed ? -1 : 0;
}
