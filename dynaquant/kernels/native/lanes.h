/* What the compiled searches share: LANES rows (sub-blocks or blocks) side by side, each lane's sums in element
   order, and the clamp with torch.clamp's NaN rule. Included; static, so each library has its own copy. */
#ifndef DQ_LANES_H
#define DQ_LANES_H

#include <stdint.h>

#define LANES 16

/* torch.clamp: NaN passes through */
static inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* Load LANES rows of L elements (of n rows in all, from row j0) of x and w transposed, [l][lane]; lanes past the end
   are zero. Returns the number of real lanes. */
static inline int load_lanes(const float *x, const float *w, int64_t n, int64_t j0, int L, float xt[][LANES],
                             float wt[][LANES]) {
    int nv = n - j0 < LANES ? (int)(n - j0) : LANES;
    if (nv == LANES) {
        for (int l = 0; l < L; l++)
            for (int v = 0; v < LANES; v++) {
                xt[l][v] = x[(j0 + v) * L + l];
                wt[l][v] = w[(j0 + v) * L + l];
            }
    } else {
        for (int l = 0; l < L; l++)
            for (int v = 0; v < LANES; v++) {
                xt[l][v] = v < nv ? x[(j0 + v) * L + l] : 0.0f;
                wt[l][v] = v < nv ? w[(j0 + v) * L + l] : 0.0f;
            }
    }
    return nv;
}

#endif
