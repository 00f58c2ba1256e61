/* The K-quant scale searches of dynaquant.quant.codecs._kquant_search, steps 1 and 2, compiled for the CPU.

   Each function repeats its torch reference's float operations in the same order and precision (float32 element
   work, float64 least squares), except the sums over a sub-block (step 1) or over a super-block's sub-blocks
   (step 2), which run in element order here and in torch's vectorised order there: results agree to rounding (the
   contract of the Triton fast paths, held by tests/test_kquant_native.py). Built with -ffp-contract=off (no fused
   multiply-adds) and without -ffast-math, so a result does not depend on the machine's vector width.

   Step 2 of the symmetric search ranks its clip steps (candidates that clamp the largest sub-block scales) with the
   exact error of a clamped sub-block (sym_clip_lanes), its grid by the quadratic alone (sym_pick_lanes).

   Speed comes from lanes: step 1 runs LANES sub-blocks side by side (an element loop whose body is one vector
   operation a lane group; each lane's sum stays in element order), step 2 runs LANES candidates side by side.
   No allocation, no threads: the Python side splits the super-blocks across threads (ctypes releases the GIL).
   Layout: x, w (n_blocks, S, L) float32 contiguous; outputs as the references return them. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "f16.h"
#include "lanes.h"

#define MAX_L 32    /* sub-block size: 16 (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K) */
#define MAX_MIDS 256 /* exhaustive candidates a sub-block: L * max(-qlo, qhi) */
#define MAX_CAND 512 /* step-1 candidates of one phase: 2 x MAX_MIDS, 2 x steps, the nonzero levels */
#define MAX_S_SYM 16 /* sub-blocks of a symmetric super-block (Q3_K, Q6_K) */

/* inv(): 1 / b where b != 0, else 0 (the quotient computed either way: a select, not a branch, in vector loops) */
static inline float invf(float b) {
    float r = 1.0f / b;
    return b != 0.0f ? r : 0.0f;
}
/* clampf where lo <= hi, for the hot loops: the same value (NaN passes through, a signed zero is kept), written in
   the operand orders of the minps / maxps instructions so that the compiler emits those instead of a compare and a
   blend a side (step 1 of Q6_K 22% faster; in aff_pick_lanes it made the loop slower, so it stays on clampf) */
static inline float clamp_mm(float v, float lo, float hi) {
    float t = hi < v ? hi : v;
    return lo > t ? lo : t;
}
static inline double safe_divd(double a, double b) { return b != 0.0 ? a / b : 0.0; }

/* ------------------------------------------------------------------------------------------- step 1, symmetric */

typedef struct {
    float xt[MAX_L][LANES], wt[MAX_L][LANES], wxt[MAX_L][LANES];
    double best_gain[LANES], best_a[LANES];
    int L;
    float qlo, qhi;
} SymLanes;

/* The best-so-far update of consider() from one candidate's sums (the reference's float64 gain and scale). */
static inline void sym_keep(SymLanes *s, const float *sxq, const float *sqq) {
    for (int v = 0; v < LANES; v++) {
        double dxq = sxq[v], dqq = sqq[v];
        int nz = dqq != 0.0;
        double den = nz ? dqq : 1.0;
        double gain = nz ? dxq * dxq / den : 0.0;
        if (gain > s->best_gain[v]) {
            s->best_gain[v] = gain;
            s->best_a[v] = nz ? dxq / den : 0.0;
        }
    }
}

/* consider(): the nearest codes at inverse scale isc[c][v] of every lane, their least-squares scale and gain, for
   candidates c = 0 .. nc-1 in order. Four candidates share an element loop (eight independent sums instead of two:
   the loop is bound by the adds' latency otherwise); each lane's sums stay in element order, and the best-so-far
   updates in candidate order, so the result is that of one candidate at a time. */
static void sym_consider(SymLanes *s, float (*isc)[LANES], int nc) {
    int c = 0;
    for (; c + 4 <= nc; c += 4) {
        float sxq[4][LANES], sqq[4][LANES];
        for (int k = 0; k < 4; k++)
            for (int v = 0; v < LANES; v++) sxq[k][v] = sqq[k][v] = 0.0f;
        for (int l = 0; l < s->L; l++)
            for (int k = 0; k < 4; k++)
                for (int v = 0; v < LANES; v++) {
                    float q = clamp_mm(nearbyintf(s->xt[l][v] * isc[c + k][v]), s->qlo, s->qhi);
                    sxq[k][v] += s->wxt[l][v] * q;
                    sqq[k][v] += (s->wt[l][v] * q) * q;
                }
        for (int k = 0; k < 4; k++) sym_keep(s, sxq[k], sqq[k]);
    }
    for (; c < nc; c++) {
        float sxq[LANES], sqq[LANES];
        for (int v = 0; v < LANES; v++) sxq[v] = sqq[v] = 0.0f;
        for (int l = 0; l < s->L; l++)
            for (int v = 0; v < LANES; v++) {
                float q = clamp_mm(nearbyintf(s->xt[l][v] * isc[c][v]), s->qlo, s->qhi);
                sxq[v] += s->wxt[l][v] * q;
                sqq[v] += (s->wt[l][v] * q) * q;
            }
        sym_keep(s, sxq, sqq);
    }
}

/* Sort each lane of a[0..p)[lane] ascending (p a power of two; no NaN): a bitonic network, each compare-exchange
   one vector min and max over the lanes. */
static void bitonic_sort_lanes(float a[][LANES], int p) {
    for (int k = 2; k <= p; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1)
            for (int i = 0; i < p; i++) {
                int l = i ^ j;
                if (l <= i) continue;
                int up = (i & k) == 0;
                for (int v = 0; v < LANES; v++) {
                    float x = a[i][v], y = a[l][v];
                    float lo = x < y ? x : y, hi = x < y ? y : x;
                    a[i][v] = up ? lo : hi;
                    a[l][v] = up ? hi : lo;
                }
            }
}

/* sym_search_scales_torch for n_sub_total sub-blocks of L elements (x, w contiguous (n, L)); steps: the spec's
   steps as float32; out_a (n,) float64. */
void dq_sym_search_scales(const float *x, const float *w, int64_t n, int L, int qlo, int qhi, const float *steps,
                          int n_steps, int exhaustive, int n_elem, int iters, double *out_a) {
    SymLanes s;
    s.L = L;
    s.qlo = (float)qlo;
    s.qhi = (float)qhi;
    int m = -qlo > qhi ? -qlo : qhi;
    /* candidates of a phase: 2 x steps, 2 x MAX_MIDS midpoints or the levels of one element (at most MAX_CAND) */
    static __thread float cand[MAX_CAND][LANES], bp[MAX_MIDS][LANES];
    float inv_amax[LANES];
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        int nv = load_lanes(x, w, n, j0, L, s.xt, s.wt);
        float amax[LANES];
        for (int v = 0; v < LANES; v++) amax[v] = 0.0f;
        for (int l = 0; l < L; l++)
            for (int v = 0; v < LANES; v++) {
                s.wxt[l][v] = s.wt[l][v] * s.xt[l][v];
                float ax = fabsf(s.xt[l][v]);
                amax[v] = ax > amax[v] ? ax : amax[v]; /* amax of |x| (no NaN in weights) */
            }
        for (int v = 0; v < LANES; v++) {
            inv_amax[v] = invf(amax[v]);
            s.best_gain[v] = -1.0;
            s.best_a[v] = 0.0;
        }
        int nc = 0;
        for (int i = 0; i < n_steps; i++)
            for (int sg = 0; sg < 2; sg++) {
                float t = sg ? -steps[i] : steps[i];
                for (int v = 0; v < LANES; v++) cand[nc][v] = t * inv_amax[v];
                nc++;
            }
        sym_consider(&s, cand, nc);
        if (exhaustive) {
            int nb = L * m;
            /* every lane's breakpoints ia * (h + 1/2), padded with +inf to a power of two, sorted by a bitonic
               network run on all lanes at once (the sorted values do not depend on the algorithm) */
            int p2 = 1;
            while (p2 < nb) p2 <<= 1;
            for (int l = 0; l < L; l++) {
                float ia[LANES];
                for (int v = 0; v < LANES; v++) ia[v] = invf(fabsf(s.xt[l][v]));
                for (int h = 0; h < m; h++)
                    for (int v = 0; v < LANES; v++) bp[l * m + h][v] = ia[v] * ((float)h + 0.5f);
            }
            for (int i = nb; i < p2; i++)
                for (int v = 0; v < LANES; v++) bp[i][v] = INFINITY;
            bitonic_sort_lanes(bp, p2);
            /* the midpoints between consecutive breakpoints (the last: 1.25 x past it), each then its negation */
            for (int i = 0; i < nb; i++)
                for (int v = 0; v < LANES; v++) {
                    float mid = i + 1 < nb ? (bp[i][v] + bp[i + 1][v]) * 0.5f : bp[nb - 1][v] * 1.25f;
                    cand[2 * i][v] = mid;
                    cand[2 * i + 1][v] = -mid;
                }
            sym_consider(&s, cand, 2 * nb);
        }
        if (n_elem > 0) {
            int ne = n_elem < L ? n_elem : L;
            /* the ne largest w x x of every lane, the first index on a tie (a select a lane: no branch to mispredict,
               the loop over lanes one vector), kept as the element's x */
            float key[MAX_L][LANES], xsel[MAX_L][LANES];
            int used[MAX_L][LANES];
            for (int l = 0; l < L; l++)
                for (int v = 0; v < LANES; v++) {
                    key[l][v] = s.wxt[l][v] * s.xt[l][v];
                    used[l][v] = 0;
                }
            for (int k = 0; k < ne; k++) {
                int bi[LANES];
                float bk[LANES], bx[LANES];
                for (int v = 0; v < LANES; v++) { bi[v] = -1; bk[v] = 0.0f; bx[v] = 0.0f; }
                for (int l = 0; l < L; l++)
                    for (int v = 0; v < LANES; v++) {
                        int take = !used[l][v] & ((bi[v] < 0) | (key[l][v] > bk[v]));
                        bi[v] = take ? l : bi[v];
                        bk[v] = take ? key[l][v] : bk[v];
                        bx[v] = take ? s.xt[l][v] : bx[v];
                    }
                for (int l = 0; l < L; l++)
                    for (int v = 0; v < LANES; v++) used[l][v] |= bi[v] == l;
                for (int v = 0; v < LANES; v++) xsel[k][v] = bx[v];
            }
            for (int k = 0; k < ne; k++) {
                float inv_xi[LANES];
                for (int v = 0; v < LANES; v++) inv_xi[v] = invf(xsel[k][v]);
                nc = 0;
                for (int lev = qlo; lev <= qhi; lev++) {
                    if (!lev) continue;
                    for (int v = 0; v < LANES; v++) cand[nc][v] = (float)lev * inv_xi[v];
                    nc++;
                }
                sym_consider(&s, cand, nc);
            }
        }
        for (int it = 0; it < iters; it++) {
            for (int v = 0; v < LANES; v++) cand[0][v] = invf((float)s.best_a[v]);
            sym_consider(&s, cand, 1);
        }
        for (int v = 0; v < nv; v++) out_a[j0 + v] = s.best_a[v];
    }
}

/* ------------------------------------------------------------------------------------------- step 1, affine */

typedef struct {
    float xt[MAX_L][LANES], wt[MAX_L][LANES], wxt[MAX_L][LANES];
    double sw[LANES], sx[LANES], sxx[LANES];
    double best_e[LANES], best_a[LANES], best_b[LANES];
    int L;
    float qmax;
} AffLanes;

static void aff_ls(double sw, double sq, double sqq, double sx, double sxq, double *pa, double *pb) {
    double det = sw * sqq - sq * sq;
    int ok = det > 1e-12 * sw * sqq;
    det = ok ? det : 0.0;
    double a = safe_divd(sw * sxq - sq * sx, det);
    double b = safe_divd(sqq * sx - sq * sxq, det);
    int fix = !ok || (b > 0) || (a < 0);
    double a2 = safe_divd(sxq, sqq);
    a2 = a2 < 0 ? 0.0 : a2; /* clamp_min(0), NaN passes */
    double b2 = safe_divd(sx - a2 * sq, sw);
    b2 = b2 > 0 ? 0.0 : b2;
    *pa = fix ? a2 : a;
    *pb = fix ? b2 : b;
}

/* The best-so-far update of consider() from one candidate's sums (the reference's float64 least squares). */
static inline void aff_keep(AffLanes *s, const float *sq, const float *sqq, const float *sxq) {
    for (int v = 0; v < LANES; v++) {
        double dsq = sq[v], dsqq = sqq[v], dsxq = sxq[v], a, b;
        double sw = s->sw[v], sx = s->sx[v], sxx = s->sxx[v];
        aff_ls(sw, dsq, dsqq, sx, dsxq, &a, &b);
        double e = sxx - 2 * a * dsxq - 2 * b * sx + a * a * dsqq + 2 * a * b * dsq + b * b * sw;
        if (e < s->best_e[v]) {
            s->best_e[v] = e;
            s->best_a[v] = a;
            s->best_b[v] = b;
        }
    }
}

/* One element's code and sums for candidate (b0, isc); aff_codes: (x + ml) * inv(dl), the step candidates:
   (x - b0) * iscale. */
#define AFF_TERM(xv, wv, wxv, b0v, iscv, plus_ml, qmax, sq, sqq, sxq)                                             \
    do {                                                                                                           \
        float y_ = (plus_ml) ? (xv) + (b0v) : (xv) - (b0v);                                                       \
        float q_ = clampf(nearbyintf(y_ * (iscv)), 0.0f, (qmax));                                                 \
        float wq_ = (wv) * q_;                                                                                     \
        (sq) += wq_;                                                                                               \
        (sqq) += wq_ * q_;                                                                                         \
        (sxq) += (wxv) * q_;                                                                                       \
    } while (0)

/* consider(): codes q given as (x - b0[c][v]) * isc[c][v] (b0 = -ml for aff_codes' form), rounded and clamped to
   [0, qmax], for candidates c = 0 .. nc-1 in order; four share an element loop, as in sym_consider. */
static void aff_consider(AffLanes *s, float (*b0)[LANES], float (*isc)[LANES], int nc, int plus_ml) {
    int c = 0;
    for (; c + 4 <= nc; c += 4) {
        float sq[4][LANES], sqq[4][LANES], sxq[4][LANES];
        for (int k = 0; k < 4; k++)
            for (int v = 0; v < LANES; v++) sq[k][v] = sqq[k][v] = sxq[k][v] = 0.0f;
        for (int l = 0; l < s->L; l++)
            for (int k = 0; k < 4; k++)
                for (int v = 0; v < LANES; v++)
                    AFF_TERM(s->xt[l][v], s->wt[l][v], s->wxt[l][v], b0[c + k][v], isc[c + k][v], plus_ml, s->qmax,
                             sq[k][v], sqq[k][v], sxq[k][v]);
        for (int k = 0; k < 4; k++) aff_keep(s, sq[k], sqq[k], sxq[k]);
    }
    for (; c < nc; c++) {
        float sq[LANES], sqq[LANES], sxq[LANES];
        for (int v = 0; v < LANES; v++) sq[v] = sqq[v] = sxq[v] = 0.0f;
        for (int l = 0; l < s->L; l++)
            for (int v = 0; v < LANES; v++)
                AFF_TERM(s->xt[l][v], s->wt[l][v], s->wxt[l][v], b0[c][v], isc[c][v], plus_ml, s->qmax, sq[v], sqq[v],
                         sxq[v]);
        aff_keep(s, sq, sqq, sxq);
    }
}

/* aff_search_scales_torch for n sub-blocks of L elements; steps, shifts as float32; out_a, out_b (n,) float64. */
void dq_aff_search_scales(const float *x, const float *w, int64_t n, int L, int qmax, const float *steps, int n_steps,
                          const float *shifts, int n_shifts, int iters, double *out_a, double *out_b) {
    AffLanes s;
    s.L = L;
    s.qmax = (float)qmax;
    static __thread float isc[MAX_CAND][LANES], b0[MAX_CAND][LANES]; /* steps x shifts <= MAX_CAND */
    float lo[LANES], rng[LANES], inv_rng[LANES];
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        int nv = n - j0 < LANES ? (int)(n - j0) : LANES;
        for (int v = 0; v < LANES; v++) {
            float sw = 0.0f, sx = 0.0f, sxx = 0.0f, mn = 0.0f, mx = 0.0f;
            for (int l = 0; l < L; l++) {
                float xv = v < nv ? x[(j0 + v) * L + l] : 0.0f, wv = v < nv ? w[(j0 + v) * L + l] : 0.0f;
                float wx = wv * xv;
                s.xt[l][v] = xv;
                s.wt[l][v] = wv;
                s.wxt[l][v] = wx;
                sw += wv;
                sx += wx;
                sxx += wx * xv;
                if (l == 0 || xv < mn) mn = xv;
                if (l == 0 || xv > mx) mx = xv;
            }
            s.sw[v] = sw;
            s.sx[v] = sx;
            s.sxx[v] = sxx;
            lo[v] = mn < 0.0f ? mn : 0.0f;
            rng[v] = mx - lo[v];
            inv_rng[v] = invf(rng[v]);
            s.best_e[v] = INFINITY;
            s.best_a[v] = s.best_b[v] = 0.0;
        }
        int nc = 0;
        for (int i = 0; i < n_steps; i++) {
            float t = steps[i];
            for (int k = 0; k < n_shifts; k++, nc++)
                for (int v = 0; v < LANES; v++) {
                    isc[nc][v] = t * inv_rng[v];
                    b0[nc][v] = lo[v] + (shifts[k] * rng[v]) / t;
                }
        }
        aff_consider(&s, b0, isc, nc, 0);
        for (int it = 0; it < iters; it++) {
            for (int v = 0; v < LANES; v++) {
                b0[0][v] = (float)(-s.best_b[v]); /* ml */
                isc[0][v] = invf((float)s.best_a[v]);
            }
            aff_consider(&s, b0, isc, 1, 1);
        }
        for (int v = 0; v < nv; v++) {
            out_a[j0 + v] = s.best_a[v];
            out_b[j0 + v] = s.best_b[v];
        }
    }
}

/* ------------------------------------------------------------------------------------------- step 2, symmetric */

/* One sub-block's term of sym_eval_error (the quadratic alone) for LANES candidates d (inverses id), added to e. */
static inline void sym_pick_lanes(const float *restrict d, const float *restrict id, float aj, float qj, float flo,
                                  float fhi, float *restrict e) {
    for (int v = 0; v < LANES; v++) {
        float k0 = clamp_mm(floorf(aj * id[v]), flo, fhi);
        float k1 = clamp_mm(k0 + 1.0f, flo, fhi);
        float r0 = d[v] * k0 - aj, r1 = d[v] * k1 - aj;
        float e0 = qj * r0 * r0, e1 = qj * r1 * r1;
        e[v] += e1 < e0 ? e1 : e0; /* torch.minimum (no NaN here) */
    }
}

/* The exact error of one sub-block's L elements (x, w) at the scales d k of LANES candidates: sym_error's terms in
   element order, codes re-rounded. */
static inline void sym_pick_exact(const float *restrict d, const float *restrict k, const float *restrict xj,
                                  const float *restrict wj, int L, float qlo, float qhi, float *restrict ex) {
    float dl[LANES], idl[LANES];
    for (int v = 0; v < LANES; v++) {
        dl[v] = d[v] * k[v];
        idl[v] = invf(dl[v]);
        ex[v] = 0.0f;
    }
    for (int l = 0; l < L; l++)
        for (int v = 0; v < LANES; v++) {
            float q = clamp_mm(nearbyintf(xj[l] * idl[v]), qlo, qhi);
            float r = xj[l] - dl[v] * q;
            ex[v] += (wj[l] * r) * r;
        }
}

/* sym_clip_error of LANES candidates d over a super-block's S sub-blocks -> e (sums in sub-block order): the
   quadratic terms, but where a lane clamps 1 to clip_max sub-blocks, those sub-blocks' exact errors at the clamped
   scale (one vector pass over a clamped sub-block's elements for all lanes). */
static void sym_clip_lanes(const float *restrict d, const float *restrict ab, const float *restrict qb,
                           const float *restrict xb, const float *restrict wb, int S, int L, float flo, float fhi,
                           float qlo, float qhi, int clip_max, float *restrict e) {
    float id[LANES], cnt[LANES];
    for (int v = 0; v < LANES; v++) {
        id[v] = invf(d[v]);
        cnt[v] = e[v] = 0.0f;
    }
    for (int j = 0; j < S; j++)
        for (int v = 0; v < LANES; v++) {
            float f = floorf(ab[j] * id[v]);
            cnt[v] += (f < flo) | (f >= fhi) ? 1.0f : 0.0f;
        }
    const float cmax = (float)clip_max;
    for (int j = 0; j < S; j++) {
        float eq[LANES], k0[LANES], ex[LANES];
        int any = 0;
        for (int v = 0; v < LANES; v++) {
            float f = floorf(ab[j] * id[v]);
            k0[v] = clamp_mm(f, flo, fhi);
            float k1 = clamp_mm(k0[v] + 1.0f, flo, fhi);
            float r0 = d[v] * k0[v] - ab[j], r1 = d[v] * k1 - ab[j];
            float e0 = qb[j] * r0 * r0, e1 = qb[j] * r1 * r1;
            eq[v] = e1 < e0 ? e1 : e0;
            any |= ((f < flo) | (f >= fhi)) & (cnt[v] <= cmax);
        }
        if (any) {
            sym_pick_exact(d, k0, xb + j * L, wb + j * L, L, qlo, qhi, ex);
            for (int v = 0; v < LANES; v++) {
                float f = floorf(ab[j] * id[v]);
                eq[v] = ((f < flo) | (f >= fhi)) & (cnt[v] <= cmax) ? ex[v] : eq[v];
            }
        }
        for (int v = 0; v < LANES; v++) e[v] += eq[v];
    }
}

/* sym_pick_torch for n super-blocks of S sub-blocks of L: x, w (n, S, L) float32, a, sqq (n, S) float32, cand
   (n, C) float32 ranked by sym_eval_error, or with clip by sym_clip_error -> out_d (n,) float32, out_k (n, S) int64.
   Candidates run LANES at a time, each lane's sum over sub-blocks in order. */
void dq_sym_pick(const float *x, const float *w, const float *a, const float *sqq, int64_t n, int S, int L, int qlo,
                 int qhi, int klo, int khi, int clip_max, const float *cand, int C, int clip, float *out_d,
                 int64_t *out_k) {
    const float flo = (float)klo, fhi = (float)khi, fqlo = (float)qlo, fqhi = (float)qhi;
    for (int64_t b = 0; b < n; b++) {
        const float *ab = a + b * S, *qb = sqq + b * S, *cb = cand + b * (int64_t)C;
        const float *xb = x + b * S * L, *wb = w + b * S * L;
        float best_e = 0.0f, best_d = 0.0f;
        int have = 0;
        for (int c0 = 0; c0 < C; c0 += LANES) {
            int nc = C - c0 < LANES ? C - c0 : LANES;
            float d[LANES], id[LANES], e[LANES];
            for (int v = 0; v < LANES; v++) {
                d[v] = v < nc ? cb[c0 + v] : 0.0f;
                id[v] = invf(d[v]);
                e[v] = 0.0f;
            }
            if (!clip)
                for (int j = 0; j < S; j++) sym_pick_lanes(d, id, ab[j], qb[j], flo, fhi, e);
            else
                sym_clip_lanes(d, ab, qb, xb, wb, S, L, flo, fhi, fqlo, fqhi, clip_max, e);
            for (int v = 0; v < nc; v++) {
                if (!have || e[v] < best_e) { best_e = e[v]; best_d = d[v]; have = 1; }
            }
        }
        out_d[b] = best_d;
        float id = invf(best_d);
        for (int j = 0; j < S; j++) {
            float k0 = clamp_mm(floorf(ab[j] * id), flo, fhi);
            float k1 = clamp_mm(k0 + 1.0f, flo, fhi);
            float r0 = best_d * k0 - ab[j], r1 = best_d * k1 - ab[j];
            float e0 = qb[j] * r0 * r0, e1 = qb[j] * r1 * r1;
            out_k[b * S + j] = (int64_t)(e1 < e0 ? k1 : k0);
        }
    }
}

/* ------------------------------------------------------------------------------------------- step 2, affine */

/* _aff_choices for one sub-block at candidate (d, dm): the four (ks, km, e), in the reference's order and float32
   operations. ref: a, b, ga, gb, sqq, sq, sw of the sub-block. */
static inline void aff_choices(const float *r, float kmax, float d, float dm, float *ks, float *km, float *e) {
    float a = r[0], b = r[1], ga = r[2], gb = r[3], sqq = r[4], sq = r[5], sw = r[6];
    float k0 = clampf(floorf(a * invf(d)), 0.0f, kmax);
    float ndm = -dm, idm = invf(dm), sq2 = 2.0f * sq;
    for (int i = 0; i < 2; i++) {
        float ksv = i ? clampf(k0 + 1.0f, 0.0f, kmax) : k0;
        float da = d * ksv - a;
        float mopt = (sq * da + gb) / sw - b;
        mopt = mopt < 0.0f ? 0.0f : mopt;
        float m0 = clampf(floorf(mopt * idm), 0.0f, kmax);
        float ga_da = ga * da, sqq_da2 = (sqq * da) * da, sq2_da = sq2 * da;
        for (int jm = 0; jm < 2; jm++) {
            float kmv = jm ? clampf(m0 + 1.0f, 0.0f, kmax) : m0;
            float db = ndm * kmv - b;
            float ev = (gb * db + ga_da) * 2.0f + sqq_da2;
            ev = ev + (sq2_da * db + (sw * db) * db);
            ks[2 * i + jm] = ksv;
            km[2 * i + jm] = kmv;
            e[2 * i + jm] = ev;
        }
    }
}

/* One sub-block's term of aff_eval_error (the least of aff_choices' four errors) for LANES candidates, added to e. */
static void aff_pick_lanes(const float *restrict r, float kmax, const float *restrict d, const float *restrict dm,
                           float *restrict e) {
    const float a = r[0], b = r[1], ga = r[2], gb = r[3], sqq = r[4], sq = r[5], sw = r[6], sq2 = 2.0f * sq;
    for (int v = 0; v < LANES; v++) {
        float k0 = clampf(floorf(a * invf(d[v])), 0.0f, kmax);
        float k1 = clampf(k0 + 1.0f, 0.0f, kmax);
        float ndm = -dm[v], idm = invf(dm[v]);
        /* ks = k0 */
        float da = d[v] * k0 - a;
        float mopt = (sq * da + gb) / sw - b;
        mopt = mopt < 0.0f ? 0.0f : mopt;
        float m0 = clampf(floorf(mopt * idm), 0.0f, kmax), m1 = clampf(m0 + 1.0f, 0.0f, kmax);
        float ga_da = ga * da, sqq_da2 = (sqq * da) * da, sq2_da = sq2 * da;
        float db = ndm * m0 - b;
        float e0 = (gb * db + ga_da) * 2.0f + sqq_da2;
        e0 = e0 + (sq2_da * db + (sw * db) * db);
        db = ndm * m1 - b;
        float e1 = (gb * db + ga_da) * 2.0f + sqq_da2;
        e1 = e1 + (sq2_da * db + (sw * db) * db);
        /* ks = k1 */
        da = d[v] * k1 - a;
        mopt = (sq * da + gb) / sw - b;
        mopt = mopt < 0.0f ? 0.0f : mopt;
        m0 = clampf(floorf(mopt * idm), 0.0f, kmax);
        m1 = clampf(m0 + 1.0f, 0.0f, kmax);
        ga_da = ga * da;
        sqq_da2 = (sqq * da) * da;
        sq2_da = sq2 * da;
        db = ndm * m0 - b;
        float e2 = (gb * db + ga_da) * 2.0f + sqq_da2;
        e2 = e2 + (sq2_da * db + (sw * db) * db);
        db = ndm * m1 - b;
        float e3 = (gb * db + ga_da) * 2.0f + sqq_da2;
        e3 = e3 + (sq2_da * db + (sw * db) * db);
        float m = e1 < e0 ? e1 : e0; /* torch.minimum, in the reference's order */
        m = e2 < m ? e2 : m;
        m = e3 < m ? e3 : m;
        e[v] += m;
    }
}

/* aff_pick_torch for n super-blocks of S sub-blocks: ref (7, n, S) float32 (aff_reference's tuple stacked), dc, mc
   (n, C) float32 -> out_d, out_m (n,) float32, out_ks, out_km (n, S) int64. */
void dq_aff_pick(const float *ref, int64_t n, int S, int kmax, const float *dc, const float *mc, int C, float *out_d,
                 float *out_m, int64_t *out_ks, int64_t *out_km) {
    const float fk = (float)kmax;
    const int64_t plane = n * S;
    for (int64_t b = 0; b < n; b++) {
        float r[64][7];
        for (int j = 0; j < S; j++)
            for (int t = 0; t < 7; t++) r[j][t] = ref[t * plane + b * S + j];
        const float *db_ = dc + b * (int64_t)C, *mb = mc + b * (int64_t)C;
        float best_e = 0.0f, best_d = 0.0f, best_m = 0.0f;
        int have = 0;
        for (int c0 = 0; c0 < C; c0 += LANES) {
            int nc = C - c0 < LANES ? C - c0 : LANES;
            float e[LANES], d[LANES], dm[LANES];
            for (int v = 0; v < LANES; v++) {
                d[v] = v < nc ? db_[c0 + v] : 0.0f;
                dm[v] = v < nc ? mb[c0 + v] : 0.0f;
                e[v] = 0.0f;
            }
            for (int j = 0; j < S; j++) aff_pick_lanes(r[j], fk, d, dm, e);
            for (int v = 0; v < nc; v++) {
                if (!have || e[v] < best_e) { best_e = e[v]; best_d = d[v]; best_m = dm[v]; have = 1; }
            }
        }
        out_d[b] = best_d;
        out_m[b] = best_m;
        for (int j = 0; j < S; j++) {
            float ks[4], km[4], ev[4];
            aff_choices(r[j], fk, best_d, best_m, ks, km, ev);
            float bks = ks[0], bkm = km[0], be = ev[0];
            for (int q = 1; q < 4; q++)
                if (ev[q] < be) { bks = ks[q]; bkm = km[q]; be = ev[q]; }
            out_ks[b * S + j] = (int64_t)bks;
            out_km[b * S + j] = (int64_t)bkm;
        }
    }
}

/* ------------------------------------------------------------------------------------------- step 3 */

/* The error of every lane's codes at sub-block scale dl and min ml (aff_error(x, w, dl, ml, aff_codes(...)) of the
   reference): sum(w r r), r = x - (dl q - ml), q = clamp(round((x + ml) inv(dl)), qlo, qhi). With ml = 0 it is
   sym_error(x, w, dl, sym_codes(x, dl)) bit for bit: x + 0 and a - 0 change at most the sign of a zero, and so
   neither q's magnitude nor r * r. */
static void lane_error(float xt[][LANES], float wt[][LANES], int L, const float *dl, const float *ml, float qlo,
                       float qhi, float *err) {
    float idl[LANES];
    for (int v = 0; v < LANES; v++) {
        idl[v] = invf(dl[v]);
        err[v] = 0.0f;
    }
    for (int l = 0; l < L; l++)
        for (int v = 0; v < LANES; v++) {
            float q = clamp_mm(nearbyintf((xt[l][v] + ml[v]) * idl[v]), qlo, qhi);
            float r = xt[l][v] - (dl[v] * q - ml[v]);
            err[v] += (wt[l][v] * r) * r;
        }
}

/* sym_refine_torch: n super-blocks of S sub-blocks of L; d (n,) float32; k (n, S) int64, updated in place;
   out_err (n,) float64 (the sum over sub-blocks, in order). */
void dq_sym_refine(const float *x, const float *w, int64_t n, int S, int L, const float *d, int64_t *k, int qlo,
                   int qhi, int klo, int khi, double *out_err) {
    float xt[MAX_L][LANES], wt[MAX_L][LANES], dl[LANES], err[LANES], et[LANES], zeros[LANES] = {0};
    int64_t kk[LANES], kt[LANES];
    const int64_t nsub = n * S;
    for (int64_t b = 0; b < n; b++) out_err[b] = 0.0;
    for (int64_t j0 = 0; j0 < nsub; j0 += LANES) {
        int nv = load_lanes(x, w, nsub, j0, L, xt, wt);
        for (int v = 0; v < LANES; v++) {
            kk[v] = v < nv ? k[j0 + v] : 0;
            dl[v] = v < nv ? d[(j0 + v) / S] * (float)kk[v] : 0.0f;
        }
        lane_error(xt, wt, L, dl, zeros, (float)qlo, (float)qhi, err);
        for (int delta = 1; delta >= -1; delta -= 2) {
            for (int v = 0; v < LANES; v++) {
                int64_t t = kk[v] + delta;
                kt[v] = t < klo ? klo : (t > khi ? khi : t);
                dl[v] = v < nv ? d[(j0 + v) / S] * (float)kt[v] : 0.0f;
            }
            lane_error(xt, wt, L, dl, zeros, (float)qlo, (float)qhi, et);
            for (int v = 0; v < LANES; v++)
                if (et[v] < err[v]) { err[v] = et[v]; kk[v] = kt[v]; }
        }
        for (int v = 0; v < nv; v++) k[j0 + v] = kk[v];
        for (int v = 0; v < nv; v++) out_err[(j0 + v) / S] += (double)err[v];
    }
}

/* aff_refine_torch: d, dmin (n,) float32; ks, km (n, S) int64, updated in place; moves (n_moves, 2) int32;
   out_err (n,) float64. */
void dq_aff_refine(const float *x, const float *w, int64_t n, int S, int L, const float *d, const float *dmin,
                   int64_t *ks, int64_t *km, int qmax, int kmax, const int *moves, int n_moves, double *out_err) {
    float xt[MAX_L][LANES], wt[MAX_L][LANES], dl[LANES], ml[LANES], err[LANES], et[LANES];
    int64_t cs[LANES], cm[LANES], ts[LANES], tm[LANES];
    const int64_t nsub = n * S;
    for (int64_t b = 0; b < n; b++) out_err[b] = 0.0;
    for (int64_t j0 = 0; j0 < nsub; j0 += LANES) {
        int nv = load_lanes(x, w, nsub, j0, L, xt, wt);
        for (int v = 0; v < LANES; v++) {
            cs[v] = v < nv ? ks[j0 + v] : 0;
            cm[v] = v < nv ? km[j0 + v] : 0;
            dl[v] = v < nv ? d[(j0 + v) / S] * (float)cs[v] : 0.0f;
            ml[v] = v < nv ? dmin[(j0 + v) / S] * (float)cm[v] : 0.0f;
        }
        lane_error(xt, wt, L, dl, ml, 0.0f, (float)qmax, err);
        for (int mv = 0; mv < n_moves; mv++) {
            for (int v = 0; v < LANES; v++) {
                int64_t s = cs[v] + moves[2 * mv], m = cm[v] + moves[2 * mv + 1];
                ts[v] = s < 0 ? 0 : (s > kmax ? kmax : s);
                tm[v] = m < 0 ? 0 : (m > kmax ? kmax : m);
                dl[v] = v < nv ? d[(j0 + v) / S] * (float)ts[v] : 0.0f;
                ml[v] = v < nv ? dmin[(j0 + v) / S] * (float)tm[v] : 0.0f;
            }
            lane_error(xt, wt, L, dl, ml, 0.0f, (float)qmax, et);
            for (int v = 0; v < LANES; v++)
                if (et[v] < err[v]) { err[v] = et[v]; cs[v] = ts[v]; cm[v] = tm[v]; }
        }
        for (int v = 0; v < nv; v++) {
            ks[j0 + v] = cs[v];
            km[j0 + v] = cm[v];
            out_err[(j0 + v) / S] += (double)err[v];
        }
    }
}

/* ------------------------------------------------------------------------------------------- steps 1-3 */

/* f16_candidates of one value: float32 of v, a nonzero magnitude below 2^-24 raised to +-2^-24, clamped to +-65504,
   rounded to float16 and back. */
static inline float f16_candidate(double vd) {
    const float tiny = 5.9604644775390625e-08f; /* 2^-24 */
    float v = (float)vd;
    if (v != 0.0f && fabsf(v) < tiny) v = v > 0.0f ? tiny : -tiny;
    return f16_to_f32(f32_to_f16(clampf(v, -65504.0f, 65504.0f)));
}

/* The nearest codes of every element of n_sub sub-blocks of L, one scale dl (and min ml) a sub-block: sym_codes,
   q = clamp(round(x inv(dl)), lo, hi), where ml is NULL; else aff_codes, q = clamp(round((x + ml) inv(dl)), lo, hi). */
static void codes_rows(const float *x, const float *dl, const float *ml, int64_t n_sub, int L, float lo, float hi,
                       float *q) {
    for (int64_t j = 0; j < n_sub; j++) {
        float id = invf(dl[j]);
        if (ml == NULL)
            for (int l = 0; l < L; l++) q[j * L + l] = clamp_mm(nearbyintf(x[j * L + l] * id), lo, hi);
        else
            for (int l = 0; l < L; l++) q[j * L + l] = clamp_mm(nearbyintf((x[j * L + l] + ml[j]) * id), lo, hi);
    }
}

/* sym_encode_torch (steps 1-3, spec.rounds rounds) for n super-blocks of S sub-blocks of L: out_d (n,) float32,
   out_k (n, S) int64. Returns 0, or -1 when memory runs out. d_steps as float64: the spec's d_steps (the first
   n_grid) then its clip_steps. */
int dq_sym_encode(const float *x, const float *w, int64_t n, int S, int L, int qlo, int qhi, int klo, int khi,
                  const float *steps, int n_steps, int exhaustive, int n_elem, int iters, const double *d_steps, int n_d,
                  int n_grid, int rounds, int clip_max, float *out_d, int64_t *out_k) {
    const int64_t ns = n * S;
    const int cmax = 2 * n_d + 2;
    double *a = malloc(ns * sizeof(double)), *err = malloc(n * sizeof(double)), *best_err = malloc(n * sizeof(double));
    double *sxq = malloc(ns * sizeof(double)), *sqq = malloc(ns * sizeof(double));
    float *q = malloc(ns * L * sizeof(float)), *af = malloc(ns * sizeof(float)), *sqqf = malloc(ns * sizeof(float));
    float *dl = malloc(ns * sizeof(float)), *cand = malloc(n * cmax * sizeof(float)), *d = malloc(n * sizeof(float));
    int64_t *k = malloc(ns * sizeof(int64_t));
    int ok = a && err && best_err && sxq && sqq && q && af && sqqf && dl && cand && d && k;
    if (ok) {
        dq_sym_search_scales(x, w, ns, L, qlo, qhi, steps, n_steps, exhaustive, n_elem, iters, a);
        for (int64_t j = 0; j < ns; j++) dl[j] = (float)a[j];
        codes_rows(x, dl, NULL, ns, L, (float)qlo, (float)qhi, q);
        for (int r = 0; r < rounds; r++) {
            for (int64_t j = 0; j < ns; j++) {
                float s1 = 0.0f, s2 = 0.0f;
                for (int l = 0; l < L; l++) {
                    float wv = w[j * L + l], qv = q[j * L + l];
                    s1 += (wv * x[j * L + l]) * qv;
                    s2 += (wv * qv) * qv;
                }
                sxq[j] = s1;
                sqq[j] = s2;
                a[j] = s2 != 0.0f ? sxq[j] / sqq[j] : 0.0;
                af[j] = (float)a[j];
                sqqf[j] = s2;
            }
            const int n_clip = n_d - n_grid, Cg = r > 0 ? 2 * n_grid + 2 : 2 * n_grid, Cc = 2 * n_clip;
            for (int64_t b = 0; b < n; b++) {
                const double *ab = a + b * S;
                int im = 0;
                for (int j = 1; j < S; j++)
                    if (fabs(ab[j]) > fabs(ab[im])) im = j; /* argmax: the first maximum */
                double am = ab[im];
                float *cb = cand + b * Cg, *cc = cand + n * Cg + b * Cc; /* the grid's candidates, the clip steps' */
                for (int t = 0; t < n_grid; t++) cb[t] = f16_candidate(am / d_steps[t]);
                for (int t = 0; t < n_grid; t++) cb[n_grid + t] = f16_candidate(-am / d_steps[t]);
                for (int t = 0; t < n_clip; t++) cc[t] = f16_candidate(am / d_steps[n_grid + t]);
                for (int t = 0; t < n_clip; t++) cc[n_clip + t] = f16_candidate(-am / d_steps[n_grid + t]);
                if (r > 0) { /* the kept d and its least-squares refit to the current codes and integer scales */
                    double num = 0.0, den = 0.0;
                    for (int j = 0; j < S; j++) {
                        double kf = (double)out_k[b * S + j];
                        num += kf * sxq[b * S + j];
                        den += kf * kf * sqq[b * S + j];
                    }
                    cb[2 * n_grid] = f16_candidate((double)out_d[b]);
                    cb[2 * n_grid + 1] = f16_candidate(den != 0.0 ? num / den : 0.0);
                }
            }
            /* the grid by the quadratic, then the clip steps with clipping: each picked and refined, the exact error
               keeping the best (the first on a tie) */
            for (int g = 0; g < (n_clip > 0 ? 2 : 1); g++) {
                dq_sym_pick(x, w, af, sqqf, n, S, L, qlo, qhi, klo, khi, clip_max, g ? cand + n * Cg : cand,
                            g ? Cc : Cg, g, d, k);
                dq_sym_refine(x, w, n, S, L, d, k, qlo, qhi, klo, khi, err);
                for (int64_t b = 0; b < n; b++)
                    if ((r == 0 && g == 0) || err[b] < best_err[b]) {
                        best_err[b] = err[b];
                        out_d[b] = d[b];
                        memcpy(out_k + b * S, k + b * S, S * sizeof(int64_t));
                    }
            }
            if (r + 1 < rounds) {
                for (int64_t j = 0; j < ns; j++) dl[j] = out_d[j / S] * (float)out_k[j];
                codes_rows(x, dl, NULL, ns, L, (float)qlo, (float)qhi, q);
            }
        }
    }
    free(a); free(err); free(best_err); free(sxq); free(sqq); free(q); free(af); free(sqqf); free(dl); free(cand);
    free(d); free(k);
    return ok ? 0 : -1;
}

/* aff_encode_torch (steps 1-3, rounds rounds) for n super-blocks of S sub-blocks of L: d_steps float32 (as the
   reference's tensor), moves (n_moves, 2) int32, widen (AffSearch.widen: aff_widen after step 1) -> out_d, out_m
   (n,) float32, out_ks, out_km (n, S) int64. The steps
   between the searches repeat aff_round_candidates / aff_reference / aff_ls_super in the reference's precision (sums
   over a sub-block's elements float32 then float64, over a super-block's sub-blocks float64, in order). Returns 0,
   or -1 when memory runs out. */
int dq_aff_encode(const float *x, const float *w, int64_t n, int S, int L, int qmax, int kmax, const float *steps,
                  int n_steps, const float *shifts, int n_shifts, int iters, const float *d_steps, int n_d,
                  const int *moves, int n_moves, int rounds, int widen, float *out_d, float *out_m, int64_t *out_ks,
                  int64_t *out_km) {
    const int64_t ns = n * S;
    const int cmax = n_d + 2;
    const float fq = (float)qmax, fk = (float)kmax;
    double *a = malloc(ns * sizeof(double)), *b = malloc(ns * sizeof(double));
    double *sw = malloc(ns * sizeof(double)), *sx = malloc(ns * sizeof(double)), *sq = malloc(ns * sizeof(double));
    double *sqq = malloc(ns * sizeof(double)), *sxq = malloc(ns * sizeof(double));
    double *err = malloc(n * sizeof(double)), *best_err = malloc(n * sizeof(double));
    float *q = malloc(ns * L * sizeof(float)), *ref = malloc(7 * ns * sizeof(float));
    float *dl = malloc(ns * sizeof(float)), *ml = malloc(ns * sizeof(float));
    float *dc = malloc(n * cmax * sizeof(float)), *mc = malloc(n * cmax * sizeof(float));
    float *gm = malloc(n * (n_d + 1) * sizeof(float));
    float *d = malloc(n * sizeof(float)), *dm = malloc(n * sizeof(float));
    int64_t *ks = malloc(ns * sizeof(int64_t)), *km = malloc(ns * sizeof(int64_t));
    int ok = a && b && sw && sx && sq && sqq && sxq && err && best_err && q && ref && dl && ml && dc && mc && gm && d &&
             dm && ks && km;
    if (ok) {
        dq_aff_search_scales(x, w, ns, L, qmax, steps, n_steps, shifts, n_shifts, iters, a, b);
        for (int64_t j = 0; j < ns; j++) {
            dl[j] = (float)a[j];
            ml[j] = (float)(-b[j]);
        }
        codes_rows(x, dl, ml, ns, L, 0.0f, fq, q);
        if (widen) { /* aff_widen: the used levels at the smallest scale that keeps them, A g / m, B the lowest */
            int changed = 0;
            for (int64_t j = 0; j < ns; j++) {
                float lo = q[j * L];
                for (int l = 1; l < L; l++) lo = fminf(lo, q[j * L + l]);
                int64_t g = 0, top = 0;
                for (int l = 0; l < L; l++) {
                    int64_t dv = (int64_t)(q[j * L + l] - lo), r = g;
                    if (dv > top) top = dv;
                    while (dv) { /* g = gcd(g, dv) */
                        int64_t t = r % dv;
                        r = dv;
                        dv = t;
                    }
                    g = r;
                }
                double gd = (double)g;
                double span = (double)top / (gd > 1.0 ? gd : 1.0);
                double m = floor((double)qmax / (span > 1.0 ? span : 1.0));
                double v = a[j] * (double)lo + b[j];
                if (g > 0 && m > gd && v <= 0) {
                    a[j] = a[j] * gd / m;
                    b[j] = v;
                    dl[j] = (float)a[j];
                    ml[j] = (float)(-b[j]);
                    changed = 1;
                }
            }
            if (changed) codes_rows(x, dl, ml, ns, L, 0.0f, fq, q);
        }
        for (int64_t j = 0; j < ns; j++) { /* sw, sx: sum(w), sum(w x) per sub-block, float32 then float64 */
            float s1 = 0.0f, s2 = 0.0f;
            for (int l = 0; l < L; l++) {
                s1 += w[j * L + l];
                s2 += w[j * L + l] * x[j * L + l];
            }
            sw[j] = s1;
            sx[j] = s2;
        }
        float *ra = ref, *rb = ref + ns, *rga = ref + 2 * ns, *rgb = ref + 3 * ns, *rqq = ref + 4 * ns,
              *rq = ref + 5 * ns, *rw = ref + 6 * ns;
        for (int r = 0; r < rounds; r++) {
            /* aff_round_candidates: the codes' sums and aff_reference */
            for (int64_t j = 0; j < ns; j++) {
                float s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
                for (int l = 0; l < L; l++) {
                    float wv = w[j * L + l], qv = q[j * L + l];
                    float wq = wv * qv;
                    s1 += wq;
                    s2 += wq * qv;
                    s3 += (wv * x[j * L + l]) * qv;
                }
                sq[j] = s1;
                sqq[j] = s2;
                sxq[j] = s3;
                double aj, bj;
                aff_ls(sw[j], sq[j], sqq[j], sx[j], sxq[j], &aj, &bj);
                ra[j] = (float)aj;
                rb[j] = (float)bj;
                rga[j] = (float)(aj * sqq[j] + bj * sq[j] - sxq[j]);
                rgb[j] = (float)(aj * sq[j] + bj * sw[j] - sx[j]);
                rqq[j] = (float)sqq[j];
                rq[j] = (float)sq[j];
                rw[j] = (float)sw[j];
            }
            const int C = r > 0 ? n_d + 2 : n_d + 1;
            for (int64_t bi = 0; bi < n; bi++) {
                const int64_t o = bi * S;
                float amax = ra[o], mmax = -rb[o];
                for (int j = 1; j < S; j++) {
                    if (ra[o + j] > amax) amax = ra[o + j];
                    if (-rb[o + j] > mmax) mmax = -rb[o + j];
                }
                float *dcb = dc + bi * C, *mcb = mc + bi * C, *gmb = gm + bi * (n_d + 1);
                float m_cur;
                for (int t = 0; t < n_d; t++) {
                    dcb[t] = f16_candidate((double)(amax / d_steps[t]));
                    gmb[t] = f16_candidate((double)(mmax / d_steps[t]));
                }
                if (r == 0) {
                    dcb[n_d] = f16_candidate((double)(amax / fk));
                    m_cur = f16_candidate((double)(mmax / fk));
                    mcb[n_d] = m_cur;
                } else { /* the kept (d, dmin) and aff_ls_super's least-squares pair for the kept integers */
                    double a11 = 0.0, a12 = 0.0, a22 = 0.0, b1 = 0.0, b2 = 0.0;
                    for (int j = 0; j < S; j++) {
                        double kf = (double)out_ks[o + j], mf = (double)out_km[o + j];
                        a11 += kf * kf * sqq[o + j];
                        a12 += kf * mf * sq[o + j];
                        a22 += mf * mf * sw[o + j];
                        b1 += kf * sxq[o + j];
                        b2 += mf * sx[o + j];
                    }
                    a12 = -a12;
                    b2 = -b2;
                    double det = a11 * a22 - a12 * a12;
                    double dls = safe_divd(b1 * a22 - a12 * b2, det), mls = safe_divd(a11 * b2 - a12 * b1, det);
                    if (dls <= 0 || mls < 0) {
                        dls = (double)out_d[bi];
                        mls = (double)out_m[bi];
                    }
                    m_cur = out_m[bi];
                    dcb[n_d] = out_d[bi];
                    dcb[n_d + 1] = f16_candidate(dls);
                    mcb[n_d] = m_cur;
                    mcb[n_d + 1] = f16_candidate(mls);
                }
                for (int t = 0; t < n_d; t++) mcb[t] = m_cur;
            }
            /* coordinate search: d over its grid (dmin kept), then dmin over its grid (d kept) */
            dq_aff_pick(ref, n, S, kmax, dc, mc, C, d, dm, ks, km);
            for (int64_t bi = 0; bi < n; bi++) {
                float *dcb = dc + bi * (n_d + 1), *mcb = mc + bi * (n_d + 1), *gmb = gm + bi * (n_d + 1);
                for (int t = 0; t <= n_d; t++) {
                    dcb[t] = d[bi];
                    mcb[t] = t < n_d ? gmb[t] : dm[bi];
                }
            }
            dq_aff_pick(ref, n, S, kmax, dc, mc, n_d + 1, d, dm, ks, km);
            dq_aff_refine(x, w, n, S, L, d, dm, ks, km, qmax, kmax, moves, n_moves, err);
            for (int64_t bi = 0; bi < n; bi++)
                if (r == 0 || err[bi] < best_err[bi]) {
                    best_err[bi] = err[bi];
                    out_d[bi] = d[bi];
                    out_m[bi] = dm[bi];
                    memcpy(out_ks + bi * S, ks + bi * S, S * sizeof(int64_t));
                    memcpy(out_km + bi * S, km + bi * S, S * sizeof(int64_t));
                }
            if (r + 1 < rounds) {
                for (int64_t j = 0; j < ns; j++) {
                    dl[j] = out_d[j / S] * (float)out_ks[j];
                    ml[j] = out_m[j / S] * (float)out_km[j];
                }
                codes_rows(x, dl, ml, ns, L, 0.0f, fq, q);
            }
        }
    }
    free(a); free(b); free(sw); free(sx); free(sq); free(sqq); free(sxq); free(err); free(best_err); free(q); free(ref);
    free(dl); free(ml); free(dc); free(mc); free(gm); free(d); free(dm); free(ks); free(km);
    return ok ? 0 : -1;
}

/* ------------------------------------------------------------------------------------------- block bytes */

/* The bytes of n symmetric super-blocks (kquants.sym_bytes_torch: codes_rows' nearest codes at decode's sub-block
   scales d * k, stored as llama.cpp's block_q3_K (qbits 3: hmask[32], qs[64], scales[12], d) or block_q6_K
   (qbits 6: ql[128], qh[64], scales[16], d)): x (n, 256) float32, d (n,) float32 holding float16 values, k (n, 16)
   int64 -> out (n, 110 or 210) uint8. */
void dq_sym_bytes(const float *x, int64_t n, const float *d, const int64_t *k, int qbits, uint8_t *out) {
    const int qlo = qbits == 3 ? -4 : -32, qhi = -qlo - 1, tsize = qbits == 3 ? 110 : 210;
    for (int64_t b = 0; b < n; b++) {
        float dl[16], qf[256];
        uint8_t c[256], *o = out + b * tsize;
        for (int j = 0; j < 16; j++) dl[j] = d[b] * (float)k[b * 16 + j];
        codes_rows(x + b * 256, dl, NULL, 16, 16, (float)qlo, (float)qhi, qf);
        for (int i = 0; i < 256; i++) c[i] = (uint8_t)((int)qf[i] - qlo); /* the stored value q - qlo */
        uint16_t h = f32_to_f16(d[b]);
        if (qbits == 3) {
            memset(o, 0, 32);
            for (int i = 0; i < 256; i++) o[i % 32] |= (uint8_t)((c[i] >> 2) << (i / 32)); /* hmask: bit planes */
            for (int hh = 0; hh < 2; hh++) /* qs: element 128 h + 32 s + l at bits 2 s of byte 32 h + l */
                for (int l = 0; l < 32; l++) {
                    const uint8_t *e = c + 128 * hh + l;
                    o[32 + 32 * hh + l] = (uint8_t)((e[0] & 3) | ((e[32] & 3) << 2) | ((e[64] & 3) << 4) | ((e[96] & 3) << 6));
                }
            uint8_t *sc = o + 96;
            memset(sc, 0, 12);
            for (int j = 0; j < 16; j++) { /* 6-bit k + 32: low nibbles of j and j + 8 share byte j % 8 */
                int s = (int)k[b * 16 + j] + 32;
                sc[j % 8] |= (uint8_t)((s & 15) << (j < 8 ? 0 : 4));
                sc[8 + j % 4] |= (uint8_t)((s >> 4) << (2 * (j / 4)));
            }
            o[108] = (uint8_t)(h & 255);
            o[109] = (uint8_t)(h >> 8);
        } else {
            for (int hh = 0; hh < 2; hh++) {
                for (int l = 0; l < 64; l++) /* ql: element 128 h + l low nibble, 128 h + 64 + l high, byte 64 h + l */
                    o[64 * hh + l] = (uint8_t)((c[128 * hh + l] & 15) | ((c[128 * hh + 64 + l] & 15) << 4));
                for (int l = 0; l < 32; l++) { /* qh: the high 2 bits, laid out as Q3_K's qs */
                    const uint8_t *e = c + 128 * hh + l;
                    o[128 + 32 * hh + l] =
                        (uint8_t)((e[0] >> 4) | ((e[32] >> 4) << 2) | ((e[64] >> 4) << 4) | ((e[96] >> 4) << 6));
                }
            }
            for (int j = 0; j < 16; j++) o[192 + j] = (uint8_t)(int8_t)k[b * 16 + j];
            o[208] = (uint8_t)(h & 255);
            o[209] = (uint8_t)(h >> 8);
        }
    }
}
