/* The lattice searches of the grid i-quants (dynaquant.quant.codecs._lattice), compiled for the CPU: the CPU fast
   paths lattice.nearest_codewords, lattice.candidate_terms and lattice.subset_min_costs (IQ2_XXS, IQ2_XS, IQ2_S).

   Per group of D weights (D = 4 or 8) and codeword g of the codebook:

       B_g = sum_i (w_i x_i) g_i,   C_g = sum_i w_i (g_i g_i),   M_g = min_i (w_i x_i) g_i,

   B lowered by 2 M on the groups flagged odd (the parity flip), and at a scale S the cost

       e = fma(-2 B, S, C (S S))

   which is the float operation of the torch reference of subset_min_costs (scaled_costs: c * (s * s), then
   addcmul_(b, s, value=-2), one fused multiply-add in torch's CPU kernel), so subset_min_costs and candidate_terms
   equal their references bit for bit wherever the sums over the D elements are exact (here in element order). The
   reference of nearest_codewords forms the same costs by one matmul per batch of scales ([S^2 w, -2 S w x] @
   [g^2, g]^T, its own sum order, and the flip as + 4 S M): it agrees to rounding (the contract of the Triton
   kernel, lattice_triton.py), and exactly where every product and sum is exact (dyadic scales).

   Speed comes from lanes: LANES groups side by side (GCC vector extensions; one AVX-512 register, two AVX2 ones),
   the codebook walked one codeword at a time, its coordinates broadcast, the running (min, argmin) of up to
   MAX_T scales a group kept in registers. Built with -ffp-contract=off: the only fused multiply-add is the explicit
   fmaf above, so a result does not depend on the machine's vector width. No allocation, no threads: the Python
   side splits the rows across threads (ctypes releases the GIL).

   Layout: x, w (n, D) float32; grid (G, D) float32; scale and cost (T, stride) float32 (rows r of [r0, r1) at
   column r); idx (T, stride) int64; cand (n, K) int64; b, c (n, K) float32; odd (n,) int8 or NULL. */

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#pragma GCC diagnostic ignored "-Wpsabi" /* the vector types' ABI without AVX-512: only static functions take them */

#define LANES 16
#define MAX_D 8
#define MAX_L 16    /* levels of a codebook's coordinates (nearest_codewords) */
#define MAX_T 8     /* scales a pass over the codebook (nearest_codewords) */
#define SUB_T 64    /* scales a pass (subset_min_costs) */
#define SUB_K 32    /* candidates a pass (subset_min_costs) */

typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));

#define INLINE static inline __attribute__((always_inline))

/* a * b + c rounded once (fmaf lane by lane; the machine's instruction where there is one) */
INLINE vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    typedef float h8 __attribute__((vector_size(32)));
    union { vf v; h8 h[2]; } ua = {a}, ub = {b}, uc = {c}, r;
    for (int k = 0; k < 2; k++) r.h[k] = (h8)_mm256_fmadd_ps((__m256)ua.h[k], (__m256)ub.h[k], (__m256)uc.h[k]);
    return r.v;
#else
    vf r;
    for (int i = 0; i < LANES; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
#endif
}
/* (e < *best): *best = e, *arg = g, lane by lane */
INLINE void keep_min(vf e, vi g, vf *best, vi *arg) {
#if defined(__AVX512F__)
    __mmask16 u = _mm512_cmp_ps_mask((__m512)e, (__m512)*best, _CMP_LT_OQ);
    *best = (vf)_mm512_mask_blend_ps(u, (__m512)*best, (__m512)e);
    *arg = (vi)_mm512_mask_blend_epi32(u, (__m512i)*arg, (__m512i)g);
#else
    vi u = e < *best;
    *best = (vf)((u & (vi)e) | (~u & (vi)*best));
    *arg = (u & g) | (~u & *arg);
#endif
}
INLINE vf vsel(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }
INLINE vf vmin(vf a, vf b) { return vsel(a < b, a, b); }
INLINE vf splat(float v) { return (vf){0} + v; }

/* rows j0 .. j0 + nv of an (n, D) array, transposed to [i][lane] (lanes past nv zero) */
INLINE void load_t(const float *p, int64_t j0, int nv, int D, vf *out) {
    for (int i = 0; i < D; i++) {
        vf v = {0};
        for (int l = 0; l < nv; l++) v[l] = p[(j0 + l) * D + i];
        out[i] = v;
    }
}

/* ------------------------------------------------------------------------------------------ nearest_codewords */

/* one pass over the codebook for T scales of LANES groups; D, T and parity are constants after inlining (the
   switch below), so the running minima stay in registers. The products a_i g_i and w_i g_i^2 come from the
   group's tables ap, wq (a_i, w_i times each of the grid's levels, the same float products), indexed by the
   codeword's offsets off[g][i] = i L + (level of g_i). */
INLINE void nearest_pass(const vf *ap, const vf *wq, const vi *odd_in, const uint8_t *off, int G, const int D,
                         const vf *s_in, const int T, const int parity, vf *best_out, vi *arg_out) {
    vf s[MAX_T], q[MAX_T], best[MAX_T];
    vi arg[MAX_T], odd = *odd_in;
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) {
        s[t] = s_in[t];
        q[t] = s[t] * s[t];
        best[t] = splat(INFINITY);
        arg[t] = (vi){0};
    }
    for (int g = 0; g < G; g++) {
        const uint8_t *o = off + (int64_t)g * D;
        vf p = ap[o[0]];
        vf b = p, c = wq[o[0]], m = p;
#pragma GCC unroll 8
        for (int i = 1; i < D; i++) {
            p = ap[o[i]];
            b = b + p;
            c = c + wq[o[i]];
            if (parity) m = vmin(m, p);
        }
        if (parity) b = vsel(odd, b - 2.0f * m, b);
        vf nb = -2.0f * b;
        vi gi = (vi){0} + g;
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) keep_min(vfma(nb, s[t], c * q[t]), gi, &best[t], &arg[t]);
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) {
        best_out[t] = best[t];
        arg_out[t] = arg[t];
    }
}

/* one pass of T <= MAX_T scales (D = 4 or 8) */
static void nearest_lanes(const vf *ap, const vf *wq, const vi *odd, const uint8_t *off, int G, int D, const vf *s,
                          int T, int parity, vf *best, vi *arg) {
#define DQ_PASS(DD, TT)                                                                                                \
    do {                                                                                                               \
        if (parity)                                                                                                    \
            nearest_pass(ap, wq, odd, off, G, DD, s, TT, 1, best, arg);                                                \
        else                                                                                                           \
            nearest_pass(ap, wq, odd, off, G, DD, s, TT, 0, best, arg);                                                \
    } while (0)
#define DQ_TS(DD)                                                                                                      \
    switch (T) {                                                                                                       \
        case 1: DQ_PASS(DD, 1); break;                                                                                 \
        case 2: DQ_PASS(DD, 2); break;                                                                                 \
        case 3: DQ_PASS(DD, 3); break;                                                                                 \
        case 4: DQ_PASS(DD, 4); break;                                                                                 \
        case 5: DQ_PASS(DD, 5); break;                                                                                 \
        case 6: DQ_PASS(DD, 6); break;                                                                                 \
        case 7: DQ_PASS(DD, 7); break;                                                                                 \
        default: DQ_PASS(DD, 8); break;                                                                                \
    }
    if (D == 8) {
        DQ_TS(8)
    } else {
        DQ_TS(4)
    }
#undef DQ_TS
#undef DQ_PASS
}

/* nearest_codewords_torch for rows [r0, r1) of groups of D = 4 or 8 over a codebook of G codewords whose
   coordinates take L <= MAX_L levels (lv, with squares lv2 = lv * lv as the reference's grid * grid): off (G, D)
   each coordinate's i L + level index. cost, idx (T, stride) at columns r0 .. r1. */
void dq_nearest_codewords(const float *x, const float *w, int D, const uint8_t *off, const float *lv, const float *lv2,
                          int L, int G, const float *scale, int T, int64_t stride, const int8_t *odd, int64_t r0,
                          int64_t r1, float *cost, int64_t *idx) {
    vf a[MAX_D], wt[MAX_D], s[MAX_T], best[MAX_T], ap[MAX_D * MAX_L], wq[MAX_D * MAX_L];
    vi arg[MAX_T];
    for (int64_t j0 = r0; j0 < r1; j0 += LANES) {
        int nv = r1 - j0 < LANES ? (int)(r1 - j0) : LANES;
        load_t(x, j0, nv, D, a);
        load_t(w, j0, nv, D, wt);
        for (int i = 0; i < D; i++) {
            a[i] = wt[i] * a[i];
            for (int l = 0; l < L; l++) {
                ap[i * L + l] = a[i] * lv[l];
                wq[i * L + l] = wt[i] * lv2[l];
            }
        }
        vi om = {0};
        if (odd)
            for (int l = 0; l < nv; l++) om[l] = odd[j0 + l] ? -1 : 0;
        for (int t0 = 0; t0 < T; t0 += MAX_T) {
            int nt = T - t0 < MAX_T ? T - t0 : MAX_T;
            for (int t = 0; t < nt; t++) {
                vf v = {0};
                for (int l = 0; l < nv; l++) v[l] = scale[(int64_t)(t0 + t) * stride + j0 + l];
                s[t] = v;
            }
            nearest_lanes(ap, wq, &om, off, G, D, s, nt, odd != NULL, best, arg);
            for (int t = 0; t < nt; t++)
                for (int l = 0; l < nv; l++) {
                    cost[(int64_t)(t0 + t) * stride + j0 + l] = best[t][l];
                    idx[(int64_t)(t0 + t) * stride + j0 + l] = arg[t][l];
                }
        }
    }
}

/* ------------------------------------------------------------------------------------------ candidate_terms */

/* candidate_terms_torch for n groups: b, c (n, K) */
void dq_candidate_terms(const float *x, const float *w, int D, const float *grid, const int64_t *cand, int K,
                        const int8_t *odd, int64_t n, float *b, float *c) {
    float a[MAX_D];
    for (int64_t r = 0; r < n; r++) {
        for (int i = 0; i < D; i++) a[i] = w[r * D + i] * x[r * D + i];
        int fl = odd != NULL && odd[r];
        for (int k = 0; k < K; k++) {
            const float *g = grid + cand[r * K + k] * D;
            float p = a[0] * g[0], bb = p, m = p, cc = w[r * D] * (g[0] * g[0]);
            for (int i = 1; i < D; i++) {
                p = a[i] * g[i];
                bb += p;
                cc += w[r * D + i] * (g[i] * g[i]);
                m = p < m ? p : m;
            }
            b[r * K + k] = fl ? bb - 2.0f * m : bb;
            c[r * K + k] = cc;
        }
    }
}

/* ------------------------------------------------------------------------------------------ subset_min_costs */

/* subset_min_costs_torch for rows [r0, r1): cost (T, stride) at columns r0 .. r1 */
void dq_subset_min_costs(const float *b, const float *c, int K, const float *scale, int T, int64_t stride, int64_t r0,
                         int64_t r1, float *cost) {
    vf nb[SUB_K], ct[SUB_K], best[SUB_T];
    for (int64_t j0 = r0; j0 < r1; j0 += LANES) {
        int nv = r1 - j0 < LANES ? (int)(r1 - j0) : LANES;
        for (int t0 = 0; t0 < T; t0 += SUB_T) {
            int nt = T - t0 < SUB_T ? T - t0 : SUB_T;
            for (int t = 0; t < nt; t++) best[t] = splat(INFINITY);
            for (int k0 = 0; k0 < K; k0 += SUB_K) {
                int nk = K - k0 < SUB_K ? K - k0 : SUB_K;
                for (int k = 0; k < nk; k++) {
                    vf vb = {0}, vc = {0};
                    for (int l = 0; l < nv; l++) {
                        vb[l] = b[(j0 + l) * K + k0 + k];
                        vc[l] = c[(j0 + l) * K + k0 + k];
                    }
                    nb[k] = -2.0f * vb;
                    ct[k] = vc;
                }
                for (int t = 0; t < nt; t++) {
                    vf s = {0};
                    const float *sp = scale + (int64_t)(t0 + t) * stride + j0;
                    if (nv == LANES)
                        memcpy(&s, sp, sizeof s);
                    else
                        for (int l = 0; l < nv; l++) s[l] = sp[l];
                    vf q = s * s, m = best[t];
                    for (int k = 0; k < nk; k++) m = vmin(m, vfma(nb[k], s, ct[k] * q));
                    best[t] = m;
                }
            }
            for (int t = 0; t < nt; t++) {
                float *cp = cost + (int64_t)(t0 + t) * stride + j0;
                for (int l = 0; l < nv; l++) cp[l] = best[t][l];
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------ IQ3 nearest_variants */

/* the score of grid point row g8 ([g, g^2], 8 floats) for the features fv: sum_k fv_k g8_k in element order, as the
   reference's (fv * g8.T[idx]).sum(-1) */
INLINE float point_score(const float *fv, const float *g8) {
    float s = fv[0] * g8[0];
    for (int k = 1; k < 8; k++) s += fv[k] * g8[k];
    return s;
}

/* torch.bucketize(t, mids) (right=False): how many of the 7 midpoints lie strictly below t */
INLINE int level_of(float t, const float *mids) {
    int l = 0;
    for (int k = 0; k < 7; k++) l += mids[k] < t;
    return l;
}

/* nearest_variants_torch (dynaquant.quant.codecs.iq3) for n groups of 4: f (n, 8) [2 w v, -A w], t (n, 4) v / A;
   odd (n,) int8 or NULL (V = 1); flip_at (n,) int64 or NULL (V = 5 with odd: variant 1 + i flips weight i; V = 2:
   variant 1 flips weight flip_at). kmap (4096,) grid index of each level pattern or -1; mids (7,); g8t (P, 8) each
   point's [g, g^2]; cand (4096, K) the exact candidate lists (ascending) of each pattern, cnt (4096,) their
   lengths (dominance_candidates: an off-grid variant's best point is among them; strict '>' keeps the first
   maximum, the whole grid's answer). score, idx (n, V); variants > 0 of even groups: -inf and 0. */
void dq_iq3_nearest_variants(const float *f, const float *t, int64_t n, const int8_t *odd, const int64_t *flip_at,
                             int V, const int32_t *kmap, const float *mids, const float *g8t, const int32_t *cand,
                             const int32_t *cnt, int K, float *score, int64_t *idx) {
    for (int64_t r = 0; r < n; r++) {
        const float *fr = f + r * 8, *tr = t + r * 4;
        int a[4], z[4];
        for (int i = 0; i < 4; i++) {
            a[i] = level_of(tr[i], mids);
            z[i] = level_of(-tr[i], mids);
        }
        for (int v = 0; v < V; v++) {
            if (v > 0 && !odd[r]) {
                score[r * V + v] = -INFINITY;
                idx[r * V + v] = 0;
                continue;
            }
            int fl = v == 0 ? -1 : (V == 2 ? (int)flip_at[r] : v - 1);
            float fv[8];
            int u = 0;
            for (int i = 0; i < 4; i++) {
                fv[i] = i == fl ? -fr[i] : fr[i];
                fv[4 + i] = fr[4 + i];
                u += (i == fl ? z[i] : a[i]) << (3 * i);
            }
            int p = kmap[u];
            float best;
            if (p >= 0) {
                best = point_score(fv, g8t + (int64_t)p * 8);
            } else {
                const int32_t *cp = cand + (int64_t)u * K;
                best = -INFINITY;
                p = 0;
                for (int k = 0; k < cnt[u]; k++) {
                    float s = point_score(fv, g8t + (int64_t)cp[k] * 8);
                    if (s > best) {
                        best = s;
                        p = cp[k];
                    }
                }
            }
            score[r * V + v] = best;
            idx[r * V + v] = p;
        }
    }
}

/* ------------------------------------------------------------------------------------------ IQ1 ternary_nearest */

/* iq1.nearest_points's search (dynaquant.quant.codecs.iq1; the Triton kernel ternary_nearest_kernel) for n groups of
   8: x, w (n, 8), t (n,) scales, sign (n,) +1 / -1 (the delta's sign). Level v in {-1, 0, 1} of weight i costs
   w_i |v| + a_i v, a_i = 2 w_i (sign delta - x_i / t); the free rounding's pattern p = sum_i (v_i + 1) 3^i is looked
   up in grid_of; off the grid its candidate list codes[p] (index | digits << 11, count[p] of them) is scanned, the
   costs summed in the reference's order and the first minimum kept. Every operation is the reference's: the same
   indices bit for bit. idx (n,) int64. */
void dq_ternary_nearest(const float *x, const float *w, const float *t, const float *sign, int64_t n,
                        const int32_t *grid_of, const int32_t *count, const int32_t *codes, int KP, float delta,
                        int64_t *idx) {
    static const int pow3[8] = {1, 3, 9, 27, 81, 243, 729, 2187};
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * 8, *wr = w + r * 8;
        float ts = t[r] > 0.0f ? t[r] : 1.0f, sd = sign[r] * delta, a[8], lo[8], hi[8];
        int p = 0;
        for (int i = 0; i < 8; i++) {
            a[i] = 2.0f * wr[i] * (sd - xr[i] / ts);
            p += ((a[i] < -wr[i]) - (a[i] > wr[i]) + 1) * pow3[i];
            lo[i] = wr[i] - a[i];
            hi[i] = wr[i] + a[i];
        }
        int best_idx = grid_of[p];
        if (best_idx < 0) {
            const int32_t *cp = codes + (int64_t)p * KP;
            float best = INFINITY;
            for (int k = 0; k < count[p]; k++) {
                int32_t code = cp[k];
                float c[8];
                for (int i = 0; i < 8; i++) {
                    int d = (code >> (11 + 2 * i)) & 3;
                    c[i] = d == 2 ? hi[i] : (d == 0 ? lo[i] : 0.0f);
                }
                float cost = (((c[3] + c[2]) + c[1]) + c[0]) + (((c[7] + c[6]) + c[5]) + c[4]);
                if (cost < best) {
                    best = cost;
                    best_idx = code & 2047;
                }
            }
        }
        idx[r] = best_idx;
    }
}
