/* The one-scale block searches of dynaquant.quant.codecs._blockfit, compiled for the CPU: fit_scale_torch with
   polish_scale (Q4_0, Q5_0, Q8_0: linear grids; IQ4_NL and IQ4_XS's sub-blocks: kvalues_iq4nl, midpoints on
   multiples of 1/2, rounded by a table on floor(2 t)) and fit_pow2_torch (MXFP4, NVFP4: a scale code a block, E2M1).

   Every float operation is the reference's, in its order and precision (float32), except the sums over a block's
   elements, added here in element order: results agree to rounding, and exactly where those sums are exact
   (tests/test_blockfit_native.py).

   Lanes: BL blocks side by side in GCC vector types (vf: one float of each block, one register), each lane's sums in
   element order. (Plain C loops over the lanes, as the other searches have, were vectorised by GCC along the
   elements instead, with a 16 x 16 transpose an operation: 1.7x the time.)
   Rounding to an integer is (t + 1.5 * 2^23) - 1.5 * 2^23, round half to even as nearbyintf for |t| <= 2^22; larger
   |t| give some value past 2^22 - 2 of t's sign, which the grid's clamp (|levels|, |k| < 2^21, checked by the
   Python side) turns into the end it would have been; a zero's sign may differ, which no result sees (a +-0 term
   leaves a sum that starts at +0 unchanged, 0 * q and r * r are +0 either way, and a code is clamp(q) - lo).

   Layout: x (n, N) float32 contiguous, N <= MAX_N; w (n, N), or (w_period, N) repeated (block j's importance is row
   j % w_period; the Python side passes w_period = n).
   Output (Writer): int64 codes and the scale apart (the fast paths of fit_scale / fit_pow2), or the format's block
   records straight (_records.Record's kinds; the reference is _records.pack_record). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "f16.h"

/* Blocks side by side (BL): one vector register of floats, AVX-512's 16, AVX's 8, else 4 (SSE, NEON). GCC splits
   wider vector types into pieces it moves through memory (on AVX2, 16 lanes took 3x the time of 8). A block's result
   does not depend on it. */
#if defined(__AVX512F__)
#define BL 16
#elif defined(__AVX__)
#define BL 8
#else
#define BL 4
#endif

#define MAX_N 32
#define MAX_CAND 64

#define INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(4 * BL)));
typedef int32_t vi __attribute__((vector_size(4 * BL)));

INLINE vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
INLINE vi vseli(vi m, vi a, vi b) { return (a & m) | (b & ~m); }
/* torch.clamp: NaN passes through */
INLINE vf vclamp(vf v, float lo, float hi) { return vsel(v < lo, v * 0.0f + lo, vsel(v > hi, v * 0.0f + hi, v)); }
INLINE vf vabs(vf v) { return (vf)((vi)v & 0x7fffffff); }
INLINE vf vsafe(vf d) { return vsel(d == 0.0f, d * 0.0f + 1.0f, d); } /* safe_scale */
/* nearbyintf for |t| <= 2^22 (file comment) */
INLINE vf vrint(vf t) { return (t + 12582912.0f) - 12582912.0f; }
INLINE vf vfloor(vf t) {
    vf r = vrint(t);
    return vsel(r > t, r - 1.0f, r);
}
#if defined(__AVX512F__) && BL == 16
/* AVX-512: gathers by the instruction, and tables of up to 64 entries held in registers, read by two-register
   permutes (a gather's latency was a third of MXFP4's search) */
#include <immintrin.h>
#define DQ_SMALL 64
typedef struct {
    int n;
    __m512 r[4];
} Small;
static void small_load(Small *s, const void *tab, int n) {
    float buf[DQ_SMALL] = {0};
    s->n = n;
    if (n > DQ_SMALL) return;
    memcpy(buf, tab, 4 * (size_t)n);
    for (int i = 0; i < 4; i++) s->r[i] = _mm512_loadu_ps(buf + 16 * i);
}
INLINE vf small_get(const Small *s, vi k) {
    __m512i ki = (__m512i)k;
    __m512 lo = _mm512_permutex2var_ps(s->r[0], ki, s->r[1]);
    if (s->n <= 32) return (vf)lo;
    __m512 hi = _mm512_permutex2var_ps(s->r[2], ki, s->r[3]);
    return (vf)_mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(ki, _mm512_set1_epi32(32)), lo, hi);
}
INLINE vf vgather(const float *tab, vi k) { return (vf)_mm512_i32gather_ps((__m512i)k, tab, 4); }
INLINE vi vgatheri(const int32_t *tab, vi k) { return (vi)_mm512_i32gather_epi32((__m512i)k, tab, 4); }
#else
#define DQ_SMALL 0
typedef struct {
    int n;
} Small;
static void small_load(Small *s, const void *tab, int n) {
    (void)tab;
    s->n = n;
}
INLINE vf vgather(const float *tab, vi k) {
    vf r;
    for (int v = 0; v < BL; v++) r[v] = tab[k[v]];
    return r;
}
INLINE vi vgatheri(const int32_t *tab, vi k) {
    vi r;
    for (int v = 0; v < BL; v++) r[v] = tab[k[v]];
    return r;
}
INLINE vf small_get(const Small *s, vi k) { (void)s; (void)k; return (vf)k; } /* (never called: n > DQ_SMALL) */
#endif
/* tab[k] of a table of n entries (small: the registers' copy of it) */
INLINE vf lookup(const float *tab, const Small *small, vi k) { return small->n <= DQ_SMALL ? small_get(small, k) : vgather(tab, k); }
INLINE vi lookupi(const int32_t *tab, const Small *small, vi k) {
    return small->n <= DQ_SMALL ? (vi)small_get(small, k) : vgatheri(tab, k);
}
INLINE int vany(vi m) {
    int a = 0;
    for (int v = 0; v < BL; v++) a |= m[v];
    return a != 0;
}

typedef struct {
    int linear;          /* levels lo..hi, integers */
    float lo, hi;        /* linear: the range */
    int kmin, kmax;      /* table grids: k = clamp(floor(2 t), kmin, kmax) - kmin */
    const float *vlut;   /* level value of each k */
    const int32_t *lut;  /* level index of each k */
    int zero_code;
    Small svlut, slut;   /* vlut and lut in registers where they are small */
} Grid;

static Grid make_grid(int linear, float lo, float hi, int kmin, int kmax, const float *vlut, const int32_t *lut,
                      int zero_code) {
    Grid g = {linear, lo, hi, kmin, kmax, vlut, lut, zero_code};
    int nk = linear ? DQ_SMALL + 1 : kmax - kmin + 1;
    small_load(&g.svlut, vlut, nk);
    small_load(&g.slut, lut, nk);
    return g;
}

/* The value of the level nearest t (Grid.values_of); *kk the level's key: linear, the value as an integer; a table
   grid, k (its index is lut[k]). */
INLINE vf grid_value(const Grid *g, vf t, vi *kk, const int linear) {
    if (linear) {
        vf q = vclamp(vrint(t), g->lo, g->hi);
        *kk = __builtin_convertvector(q, vi);
        return q;
    }
    vf kf = vclamp(vfloor(t * 2.0f), (float)g->kmin, (float)g->kmax) - (float)g->kmin;
    vi k = __builtin_convertvector(kf, vi);
    *kk = k;
    return lookup(g->vlut, &g->svlut, k);
}

/* The level index of a key of grid_value (Grid.codes_of) */
INLINE vi grid_code(const Grid *g, vi kk, const int linear) {
    return linear ? kk - (int32_t)g->lo : lookupi(g->lut, &g->slut, kk);
}

/* Load BL blocks of N elements from block j0 (of n) transposed, x[l] one element of each; lanes past the end are
   zero. Returns the number of real lanes. */
INLINE int load_blocks(const float *x, const float *w, int64_t n, int64_t w_period, int64_t j0, int N, vf *xt, vf *wt) {
    int nv = n - j0 < BL ? (int)(n - j0) : BL;
    int64_t jw = j0 % w_period;
    for (int v = 0; v < BL; v++) {
        if (v >= nv) {
            for (int l = 0; l < N; l++) xt[l][v] = wt[l][v] = 0.0f;
            continue;
        }
        const float *xr = x + (j0 + v) * N, *wr = w + jw * N;
        jw = jw + 1 == w_period ? 0 : jw + 1;
        for (int l = 0; l < N; l++) {
            xt[l][v] = xr[l];
            wt[l][v] = wr[l];
        }
    }
    return nv;
}

/* What a call writes (layout[]: kind, sub_blocks, code_offset, record_bytes; see _blockfit.Record) */
enum { WR_CODES = 0, WR_I8 = 1, WR_NIBBLES = 2, WR_Q5 = 3, WR_PAIRS = 4 };
typedef struct {
    int kind, sub, code_offset, rec_bytes, scale_bytes;
    const int32_t *code_map; /* stored code of each level index, or NULL (index + code_offset) */
    void *out_scale;         /* WR_CODES: (n,) uint16 (scale_bytes 2) or int64 (8) */
    void *out;               /* WR_CODES: (n, N) int64 level indices; else (n / sub, rec_bytes) uint8 records */
} Writer;

/* Write blocks j0 .. j0 + nv - 1: scale[v] the stored scale (float16 bits, or a scale code), codes[l] the level
   indices (element l of each lane). */
INLINE void write_blocks(const Writer *wr, int64_t j0, int nv, int N, const vi scale, const vi *codes) {
    if (wr->kind == WR_CODES) {
        int64_t *oc = (int64_t *)wr->out + j0 * N;
        for (int v = 0; v < nv; v++) {
            if (wr->scale_bytes == 2)
                ((uint16_t *)wr->out_scale)[j0 + v] = (uint16_t)scale[v];
            else
                ((int64_t *)wr->out_scale)[j0 + v] = scale[v];
            for (int l = 0; l < N; l++) oc[v * N + l] = codes[l][v];
        }
        return;
    }
    uint8_t c[BL][MAX_N];
    for (int l = 0; l < N; l++) {
        vi s = wr->code_map ? vgatheri(wr->code_map, codes[l]) : codes[l] + wr->code_offset;
        for (int v = 0; v < BL; v++) c[v][l] = (uint8_t)s[v];
    }
    const int sb = wr->scale_bytes, S = wr->sub, cb = wr->kind == WR_I8 ? N : (wr->kind == WR_Q5 ? N / 8 + N / 2 : N / 2);
    for (int v = 0; v < nv; v++) {
        int64_t j = j0 + v;
        uint8_t *rec = (uint8_t *)wr->out + (j / S) * wr->rec_bytes, *q = rec + S * sb + (j % S) * cb;
        uint8_t *sp = rec + (j % S) * sb;
        sp[0] = (uint8_t)scale[v];
        if (sb == 2) sp[1] = (uint8_t)(scale[v] >> 8);
        const uint8_t *cv = c[v];
        switch (wr->kind) {
        case WR_I8:
            memcpy(q, cv, N);
            break;
        case WR_NIBBLES:
            for (int i = 0; i < N / 2; i++) q[i] = (cv[i] & 15) | (cv[i + N / 2] << 4);
            break;
        case WR_PAIRS:
            for (int i = 0; i < N / 2; i++) q[i] = (cv[2 * i] & 15) | (cv[2 * i + 1] << 4);
            break;
        case WR_Q5:
            for (int i = 0; i < N / 8; i++) {
                uint8_t h = 0;
                for (int b = 0; b < 8; b++) h |= ((cv[8 * i + b] >> 4) & 1) << b;
                q[i] = h;
            }
            for (int i = 0; i < N / 2; i++) q[N / 8 + i] = (cv[i] & 15) | (cv[i + N / 2] << 4);
            break;
        }
    }
}

/* float32 -> stored float16 bits (to_half) and back, lane by lane */
INLINE vi to_half_bits(vf d) {
    vi h = {0};
    for (int v = 0; v < BL; v++) {
        float c = d[v] < -65504.0f ? -65504.0f : (d[v] > 65504.0f ? 65504.0f : d[v]);
        h[v] = f32_to_f16(c);
    }
    return h;
}
INLINE vf from_half_bits(vi h) {
    vf f = {0};
    for (int v = 0; v < BL; v++) f[v] = f16_to_f32((uint16_t)h[v]);
    return f;
}

/* polish_scale's consider(): the stored scale of d, its codes' error (q receives the values); keeps the better,
   with its codes' keys in bk. */
INLINE void consider(const Grid *g, const vf *xt, const vf *wt, int N, vf d, vf *q, vf *best_err, vi *best_d, vi *bk,
                     const int linear) {
    vi d16 = to_half_bits(d), kk[MAX_N];
    vf df = from_half_bits(d16), sd = vsafe(df), err = df * 0.0f;
    for (int l = 0; l < N; l++) {
        vf qv = grid_value(g, xt[l] / sd, &kk[l], linear);
        vf r = xt[l] - df * qv;
        q[l] = qv;
        err += wt[l] * (r * r);
    }
    vi better = err < *best_err;
    if (!vany(better)) return;
    *best_err = vsel(better, err, *best_err);
    *best_d = vseli(better, d16, *best_d);
    for (int l = 0; l < N; l++) bk[l] = vseli(better, kk[l], bk[l]);
}

/* Candidate c's least-squares score; the best kept (the first of equals) */
INLINE void keep_score(vf sqx, vf sq2, vf *best_score, vf *best_dc) {
    vi pos = sq2 > 0.0f;
    vf den = vsel(pos, sq2, sq2 * 0.0f + 1.0f);
    vf score = vsel(pos, sqx * sqx / den, sq2 * 0.0f - 1.0f);
    vi better = score > *best_score;
    *best_score = vsel(better, score, *best_score);
    *best_dc = vsel(better, sqx / den, *best_dc);
}

/* fit_scale_torch's body for one kind of grid (linear a constant: the compiler makes two copies). */
INLINE void fit_scale(const float *x, const float *w, int64_t n, int N, int64_t w_period, const Grid g,
                      const float *levels, int n_levels, const float *targets, int T, const int32_t *offsets, int A,
                      int lloyd_steps, const Writer *wr, const int linear) {
    const float lev_abs_max = fabsf(g.lo) > fabsf(g.hi) ? fabsf(g.lo) : fabsf(g.hi);
    vf xt[MAX_N], wt[MAX_N], wxt[MAX_N], q[MAX_N], inv[MAX_CAND];
    vi bk[MAX_N], codes[MAX_N];
    for (int64_t j0 = 0; j0 < n; j0 += BL) {
        int nv = load_blocks(x, w, n, w_period, j0, N, xt, wt);
        /* the largest |x| and the largest w x^2 (argmax: the first maximum) */
        vf zero = xt[0] * 0.0f, am = zero - 1.0f, xmax = zero, bkey = zero, xj = zero;
        for (int l = 0; l < N; l++) {
            vf xv = xt[l], wv = wt[l], ax = vabs(xv), key = (wv * xv) * xv;
            wxt[l] = wv * xv;
            vi a = ax > am, k = l == 0 ? (vi)(zero == zero) : key > bkey;
            am = vsel(a, ax, am);
            xmax = vsel(a, xv, xmax);
            bkey = vsel(k, key, bkey);
            xj = vsel(k, xv, xj);
        }
        /* candidate inverse scales: the targets for the max, then the anchors */
        vf sx = vsafe(xmax);
        for (int c = 0; c < T; c++) inv[c] = targets[c] / sx;
        if (A > 0) {
            vf d_nom = vabs(xmax) / lev_abs_max, sdn = vsafe(d_nom), sxj = vsafe(xj), fallback = 1.0f / sdn;
            vi kk;
            grid_value(&g, xj / sdn, &kk, linear);
            vi i0 = grid_code(&g, kk, linear);
            for (int o = 0; o < A; o++) {
                vi i = i0 + offsets[o];
                vi ok = (i >= 0) & (i < n_levels);
                vi ic = vseli(i < 0, i * 0, vseli(i >= n_levels, i * 0 + (n_levels - 1), i));
                vf lvl = vgather(levels, ic);
                ok &= lvl != 0.0f;
                inv[T + o] = vsel(ok, lvl / sxj, fallback);
            }
        }
        vf best_score = zero - 1.0f, best_dc = zero;
        int C = T + A, c = 0;
        for (; c + 1 < C; c += 2) { /* two candidates a pass: two chains of sums side by side */
            vf sqx0 = zero, sq20 = zero, sqx1 = zero, sq21 = zero, i0 = inv[c], i1 = inv[c + 1];
            vi kk;
            for (int l = 0; l < N; l++) {
                vf q0 = grid_value(&g, xt[l] * i0, &kk, linear), q1 = grid_value(&g, xt[l] * i1, &kk, linear);
                sqx0 += q0 * wxt[l];
                sq20 += (q0 * q0) * wt[l];
                sqx1 += q1 * wxt[l];
                sq21 += (q1 * q1) * wt[l];
            }
            keep_score(sqx0, sq20, &best_score, &best_dc);
            keep_score(sqx1, sq21, &best_score, &best_dc);
        }
        if (c < C) {
            vf sqx = zero, sq2 = zero;
            vi kk;
            for (int l = 0; l < N; l++) {
                vf qv = grid_value(&g, xt[l] * inv[c], &kk, linear);
                sqx += qv * wxt[l];
                sq2 += (qv * qv) * wt[l];
            }
            keep_score(sqx, sq2, &best_score, &best_dc);
        }
        /* polish: the all-zero block, the stored scale, Lloyd steps on the last codes */
        vf best_err = zero;
        vi best_d = (vi)zero & 0;
        for (int l = 0; l < N; l++) {
            best_err += wxt[l] * xt[l];
            bk[l] = best_d;
        }
        consider(&g, xt, wt, N, best_dc, q, &best_err, &best_d, bk, linear);
        for (int s = 0; s < lloyd_steps; s++) {
            vf sq2 = zero, sxq = zero;
            for (int l = 0; l < N; l++) {
                sq2 += (wt[l] * q[l]) * q[l];
                sxq += wxt[l] * q[l];
            }
            vf d = vsel(sq2 > 0.0f, sxq / sq2, from_half_bits(best_d));
            consider(&g, xt, wt, N, d, q, &best_err, &best_d, bk, linear);
        }
        /* the codes nearest under the stored scale: the best consider's (zero_code where it is 0) */
        vi dz = from_half_bits(best_d) == 0.0f;
        for (int l = 0; l < N; l++) codes[l] = vseli(dz, best_d * 0 + g.zero_code, grid_code(&g, bk[l], linear));
        write_blocks(wr, j0, nv, N, best_d, codes);
    }
}

static Writer writer(const int32_t *layout, const int32_t *code_map, int scale_bytes, void *out_scale, void *out) {
    Writer wr = {layout[0], layout[1], layout[2], layout[3], scale_bytes, code_map, out_scale, out};
    return wr;
}

/* fit_scale_torch with ulps = (): x, w as the file comment; a linear grid (lo..hi) or a table grid (kmin, kmax, vlut,
   lut); targets (T,), anchor_offsets (A,) int32, levels (n_levels,) float32 ascending; layout (4,) int32 and code_map
   the Writer (WR_CODES: out_d (n,) float16 bits, out (n, N) int64; else out the records, out_d unused). */
void dq_fit_scale(const float *x, const float *w, int64_t n, int N, int64_t w_period, int linear, float lo, float hi,
                  int kmin, int kmax, const float *vlut, const int32_t *lut, int zero_code, const float *levels,
                  int n_levels, const float *targets, int T, const int32_t *offsets, int A, int lloyd_steps,
                  const int32_t *layout, const int32_t *code_map, uint16_t *out_d, void *out) {
    Grid g = make_grid(linear, lo, hi, kmin, kmax, vlut, lut, zero_code);
    Writer wr = writer(layout, code_map, 2, out_d, out);
    if (linear)
        fit_scale(x, w, n, N, w_period, g, levels, n_levels, targets, T, offsets, A, lloyd_steps, &wr, 1);
    else
        fit_scale(x, w, n, N, w_period, g, levels, n_levels, targets, T, offsets, A, lloyd_steps, &wr, 0);
}

/* fit_pow2_torch: a scale code a block from a table (E8M0, UE4M3), table grids only (E2M1). Start codes: e0 (n,) int64,
   or, with e0 NULL, floor(log2(amax)) + e0_bias where the block's amax > 0, else 0 (MXFP4's); offsets (n_off,)
   tried in order, each clamped to [emin, emax]; scale_table[code] the decoder's scale (> 0 for every code reached:
   x / d stays finite or infinite, never NaN); inv_table[code] 1 / scale where that is exact (a power of two whose
   reciprocal is a normal float: x * inv is then x / d bit for bit), else 0. zero_empty: a block whose amax is 0 gets
   scale code 0 (NVFP4's). layout, code_map: the Writer (WR_CODES: out_e (n,) int64, out (n, N) int64). */
void dq_fit_pow2(const float *x, const float *w, int64_t n, int N, int64_t w_period, int kmin, int kmax,
                 const float *vlut, const int32_t *lut, const int64_t *e0, int e0_bias, const int32_t *offsets,
                 int n_off, int emin, int emax, const float *scale_table, const float *inv_table, int zero_empty,
                 const int32_t *layout, const int32_t *code_map, int64_t *out_e, void *out) {
    Grid g = make_grid(0, 0.0f, 0.0f, kmin, kmax, vlut, lut, 0);
    Writer wr = writer(layout, code_map, layout[0] == WR_CODES ? 8 : 1, out_e, out);
    vf xt[MAX_N], wt[MAX_N];
    vi bk[MAX_N], kk[MAX_N], codes[MAX_N];
    for (int64_t j0 = 0; j0 < n; j0 += BL) {
        int nv = load_blocks(x, w, n, w_period, j0, N, xt, wt);
        vf zero = xt[0] * 0.0f, amax = zero;
        for (int l = 0; l < N; l++) amax = vsel(vabs(xt[l]) > amax, vabs(xt[l]), amax);
        vi start;
        for (int v = 0; v < BL; v++) {
            if (e0 != NULL) {
                start[v] = v < nv ? (int32_t)e0[j0 + v] : emin;
            } else {
                int ex;
                frexpf(amax[v], &ex);
                start[v] = amax[v] > 0.0f ? ex - 1 + e0_bias : 0;
            }
        }
        vf best_err = zero;
        vi best_e = start * 0 + emin;
        for (int k = 0; k < n_off; k++) {
            vi e = start + offsets[k];
            e = vseli(e < emin, e * 0 + emin, vseli(e > emax, e * 0 + emax, e));
            vf d = vgather(scale_table, e), inv = vgather(inv_table, e), err = zero;
            if (vany(inv == 0.0f)) {
                for (int l = 0; l < N; l++) {
                    vf r = xt[l] - d * grid_value(&g, xt[l] / d, &kk[l], 0);
                    err += wt[l] * (r * r);
                }
            } else {
                for (int l = 0; l < N; l++) {
                    vf r = xt[l] - d * grid_value(&g, xt[l] * inv, &kk[l], 0);
                    err += wt[l] * (r * r);
                }
            }
            vi better = k == 0 ? (vi)(zero == zero) : err < best_err;
            if (!vany(better)) continue;
            best_err = vsel(better, err, best_err);
            best_e = vseli(better, e, best_e);
            for (int l = 0; l < N; l++) bk[l] = vseli(better, kk[l], bk[l]);
        }
        if (zero_empty) best_e = vseli(amax > 0.0f, best_e, best_e * 0);
        for (int l = 0; l < N; l++) codes[l] = grid_code(&g, bk[l], 0);
        write_blocks(&wr, j0, nv, N, best_e, codes);
    }
}
