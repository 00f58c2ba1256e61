/* The one-scale block search of dynaquant.quant.codecs._blockfit (fit_scale_torch and polish_scale), compiled for
   the CPU: Q4_0, Q5_0, Q8_0 (linear grids), IQ4_NL and IQ4_XS's sub-blocks (kvalues_iq4nl: midpoints on multiples
   of 1/2, rounded by a table on floor(2 t)).

   Every float operation is the reference's, in its order and precision (float32), except the sums over a block's
   elements, added here in element order: results agree to rounding, and exactly where those sums are exact
   (tests/test_blockfit_native.py). Lanes: LANES blocks side by side, each lane's sums in element order.
   Layout: x, w (n, N) float32 contiguous, N <= MAX_N; out_d (n,) float16 bits; out_codes (n, N) int64. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "f16.h"
#include "lanes.h"

#define MAX_N 32
#define MAX_CAND 64

static inline float safe_scale(float d) { return d == 0.0f ? 1.0f : d; }

typedef struct {
    int linear;          /* levels lo..hi, integers */
    float lo, hi;        /* linear: the range */
    int kmin, kmax;      /* table grids: k = clamp(floor(2 t), kmin, kmax) - kmin */
    const float *vlut;   /* level value of each k */
    const int32_t *lut;  /* level index of each k */
    int zero_code;
} Grid;

#define INLINE static inline __attribute__((always_inline))

INLINE float grid_value(const Grid *g, float t, const int linear) {
    if (linear) return clampf(nearbyintf(t), g->lo, g->hi);
    int k = (int)(clampf(floorf(t * 2.0f), (float)g->kmin, (float)g->kmax) - (float)g->kmin);
    return g->vlut[k];
}

INLINE int64_t grid_code(const Grid *g, float t, const int linear) {
    if (linear) return (int64_t)(clampf(nearbyintf(t), g->lo, g->hi) - g->lo);
    int k = (int)(clampf(floorf(t * 2.0f), (float)g->kmin, (float)g->kmax) - (float)g->kmin);
    return (int64_t)g->lut[k];
}

/* polish_scale's consider(): the stored scale of d, its codes' error; keeps the better; q receives the values */
INLINE void consider(const Grid *g, float (*restrict xt)[LANES], float (*restrict wt)[LANES], int N,
                     const float *restrict d, float (*restrict q)[LANES], float *restrict best_err,
                     uint16_t *restrict best_d, const int linear) {
    float df[LANES], sd[LANES], err[LANES];
    uint16_t d16[LANES];
    for (int v = 0; v < LANES; v++) {
        d16[v] = f32_to_f16(clampf(d[v], -65504.0f, 65504.0f));
        df[v] = f16_to_f32(d16[v]);
        sd[v] = safe_scale(df[v]);
        err[v] = 0.0f;
    }
    for (int l = 0; l < N; l++)
        for (int v = 0; v < LANES; v++) {
            float qv = grid_value(g, xt[l][v] / sd[v], linear);
            float r = xt[l][v] - df[v] * qv;
            q[l][v] = qv;
            err[v] += wt[l][v] * (r * r);
        }
    for (int v = 0; v < LANES; v++)
        if (err[v] < best_err[v]) {
            best_err[v] = err[v];
            best_d[v] = d16[v];
        }
}

/* fit_scale_torch's body for one kind of grid (linear a constant: the compiler makes two copies). */
INLINE void fit_scale(const float *x, const float *w, int64_t n, int N, const Grid g, const float *levels,
                      int n_levels, const float *targets, int T, const int32_t *offsets, int A, int lloyd_steps,
                      uint16_t *out_d, int64_t *out_codes, const int linear) {
    const float lo = g.lo, hi = g.hi;
    const int zero_code = g.zero_code;
    float xt[MAX_N][LANES], wt[MAX_N][LANES], wxt[MAX_N][LANES], q[MAX_N][LANES];
    float inv[MAX_CAND][LANES];
    int32_t ct[MAX_N][LANES];
    float lev_abs_max = fabsf(lo) > fabsf(hi) ? fabsf(lo) : fabsf(hi);
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        int nv = load_lanes(x, w, n, j0, N, xt, wt);
        float xmax[LANES], xj[LANES], am[LANES], bk[LANES];
        int im[LANES], ij[LANES];
        for (int v = 0; v < LANES; v++) {
            am[v] = -1.0f;
            bk[v] = 0.0f;
            im[v] = ij[v] = 0;
        }
        for (int l = 0; l < N; l++)
            for (int v = 0; v < LANES; v++) {
                float xv = xt[l][v], wv = wt[l][v];
                float ax = fabsf(xv), key = (wv * xv) * xv;
                wxt[l][v] = wv * xv;
                int a = ax > am[v], k = l == 0 || key > bk[v]; /* argmax: the first maximum */
                am[v] = a ? ax : am[v];
                im[v] = a ? l : im[v];
                bk[v] = k ? key : bk[v];
                ij[v] = k ? l : ij[v];
            }
        for (int v = 0; v < LANES; v++) {
            xmax[v] = xt[im[v]][v];
            xj[v] = xt[ij[v]][v];
        }
        /* candidate inverse scales: the targets for the max, then the anchors */
        for (int c = 0; c < T; c++)
            for (int v = 0; v < LANES; v++) inv[c][v] = targets[c] / safe_scale(xmax[v]);
        if (A > 0) {
            for (int v = 0; v < LANES; v++) {
                float d_nom = fabsf(xmax[v]) / lev_abs_max;
                int64_t i0 = grid_code(&g, xj[v] / safe_scale(d_nom), linear);
                for (int o = 0; o < A; o++) {
                    int64_t i = i0 + offsets[o];
                    int ok = i >= 0 && i < n_levels;
                    float lvl = levels[i < 0 ? 0 : (i >= n_levels ? n_levels - 1 : i)];
                    ok = ok && lvl != 0.0f;
                    inv[T + o][v] = ok ? lvl / safe_scale(xj[v]) : 1.0f / safe_scale(d_nom);
                }
            }
        }
        float best_score[LANES], best_dc[LANES];
        for (int v = 0; v < LANES; v++) { best_score[v] = -1.0f; best_dc[v] = 0.0f; }
        for (int c = 0; c < T + A; c++) {
            float sqx[LANES], sq2[LANES];
            for (int v = 0; v < LANES; v++) sqx[v] = sq2[v] = 0.0f;
            for (int l = 0; l < N; l++)
                for (int v = 0; v < LANES; v++) {
                    float qv = grid_value(&g, xt[l][v] * inv[c][v], linear);
                    sqx[v] += qv * wxt[l][v];
                    sq2[v] += (qv * qv) * wt[l][v];
                }
            for (int v = 0; v < LANES; v++) {
                int pos = sq2[v] > 0.0f;
                float den = pos ? sq2[v] : 1.0f;
                float score = pos ? sqx[v] * sqx[v] / den : -1.0f;
                if (score > best_score[v]) { best_score[v] = score; best_dc[v] = sqx[v] / den; }
            }
        }
        /* polish: the all-zero block, the stored scale, Lloyd steps on the last codes */
        float best_err[LANES];
        uint16_t best_d[LANES];
        for (int v = 0; v < LANES; v++) { best_err[v] = 0.0f; best_d[v] = 0; }
        for (int l = 0; l < N; l++)
            for (int v = 0; v < LANES; v++) best_err[v] += wxt[l][v] * xt[l][v];
        consider(&g, xt, wt, N, best_dc, q, best_err, best_d, linear);
        for (int s = 0; s < lloyd_steps; s++) {
            float sq2[LANES], sxq[LANES], d[LANES];
            for (int v = 0; v < LANES; v++) sq2[v] = sxq[v] = 0.0f;
            for (int l = 0; l < N; l++)
                for (int v = 0; v < LANES; v++) {
                    sq2[v] += (wt[l][v] * q[l][v]) * q[l][v];
                    sxq[v] += wxt[l][v] * q[l][v];
                }
            for (int v = 0; v < LANES; v++) d[v] = sq2[v] > 0.0f ? sxq[v] / sq2[v] : f16_to_f32(best_d[v]);
            consider(&g, xt, wt, N, d, q, best_err, best_d, linear);
        }
        float df[LANES], sd[LANES];
        for (int v = 0; v < LANES; v++) {
            df[v] = f16_to_f32(best_d[v]);
            sd[v] = safe_scale(df[v]);
        }
        for (int l = 0; l < N; l++)
            for (int v = 0; v < LANES; v++)
                ct[l][v] = df[v] == 0.0f ? (int32_t)zero_code : (int32_t)grid_code(&g, xt[l][v] / sd[v], linear);
        for (int v = 0; v < nv; v++) {
            out_d[j0 + v] = best_d[v];
            for (int l = 0; l < N; l++) out_codes[(j0 + v) * N + l] = ct[l][v];
        }
    }
}

/* fit_scale_torch with ulps = (): x, w (n, N); a linear grid (lo..hi) or a table grid (kmin, kmax, vlut, lut);
   targets (T,), anchor_offsets (A,) int32, levels (n_levels,) float32 ascending; out_d (n,) float16 bits, out_codes
   (n, N) int64. */
void dq_fit_scale(const float *x, const float *w, int64_t n, int N, int linear, float lo, float hi, int kmin, int kmax,
                  const float *vlut, const int32_t *lut, int zero_code, const float *levels, int n_levels,
                  const float *targets, int T, const int32_t *offsets, int A, int lloyd_steps, uint16_t *out_d,
                  int64_t *out_codes) {
    Grid g = {linear, lo, hi, kmin, kmax, vlut, lut, zero_code};
    if (linear)
        fit_scale(x, w, n, N, g, levels, n_levels, targets, T, offsets, A, lloyd_steps, out_d, out_codes, 1);
    else
        fit_scale(x, w, n, N, g, levels, n_levels, targets, T, offsets, A, lloyd_steps, out_d, out_codes, 0);
}

/* fit_pow2_torch: a power-of-two style scale code a block (E8M0, UE4M3), table grids only (E2M1). e0 (n,) int64 start
   codes; offsets (n_off,) tried in order, each clamped to [emin, emax]; scale_table[code] the decoder's scale (> 0
   for every code reached: x / d stays finite or infinite, never NaN); out_e (n,) int64, out_codes (n, N) int64. */
void dq_fit_pow2(const float *x, const float *w, int64_t n, int N, int kmin, int kmax, const float *vlut,
                 const int32_t *lut, const int64_t *e0, const int32_t *offsets, int n_off, int emin, int emax,
                 const float *scale_table, int64_t *out_e, int64_t *out_codes) {
    Grid g = {0, 0.0f, 0.0f, kmin, kmax, vlut, lut, 0};
    float xt[MAX_N][LANES], wt[MAX_N][LANES];
    int32_t ct[MAX_N][LANES];
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        int nv = load_lanes(x, w, n, j0, N, xt, wt);
        float best_err[LANES], d[LANES], err[LANES];
        int64_t best_e[LANES], e[LANES];
        for (int v = 0; v < LANES; v++) {
            best_err[v] = 0.0f;
            best_e[v] = emin; /* (replaced by the first offset's) */
        }
        for (int k = 0; k < n_off; k++) {
            for (int v = 0; v < LANES; v++) {
                int64_t c = (v < nv ? e0[j0 + v] : emin) + offsets[k];
                e[v] = c < emin ? emin : (c > emax ? emax : c);
                d[v] = scale_table[e[v]];
                err[v] = 0.0f;
            }
            for (int l = 0; l < N; l++)
                for (int v = 0; v < LANES; v++) {
                    float q = grid_value(&g, xt[l][v] / d[v], 0);
                    float r = xt[l][v] - d[v] * q;
                    err[v] += wt[l][v] * (r * r);
                }
            for (int v = 0; v < LANES; v++)
                if (k == 0 || err[v] < best_err[v]) {
                    best_err[v] = err[v];
                    best_e[v] = e[v];
                }
        }
        for (int v = 0; v < LANES; v++) d[v] = scale_table[best_e[v]];
        for (int l = 0; l < N; l++)
            for (int v = 0; v < LANES; v++) ct[l][v] = (int32_t)grid_code(&g, xt[l][v] / d[v], 0);
        for (int v = 0; v < nv; v++) {
            out_e[j0 + v] = best_e[v];
            for (int l = 0; l < N; l++) out_codes[(j0 + v) * N + l] = ct[l][v];
        }
    }
}
