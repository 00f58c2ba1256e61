/* float <-> IEEE float16 bits, shared by the compiled searches (included; static, so each library has its own). */
#ifndef DQ_F16_H
#define DQ_F16_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* float -> float16 bits, round to nearest even (finite input, |f| <= 65504 after to_half's clamp) */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504: inf (not reached: clamped) */
    if (ax < 0x38800000u) { /* below 2^-14: a subnormal half (or the smallest normal after rounding) */
        float af;
        memcpy(&af, &ax, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(af * 16777216.0f)); /* in units of 2^-24, exact product */
    }
    uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
    uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u, x;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-08f; /* 2^-24: exact */
        return (h & 0x8000u) ? -v : v;
    }
    x = e == 31 ? (sign | 0x7f800000u | (m << 13)) : (sign | ((e + 112u) << 23) | (m << 13));
    float f;
    memcpy(&f, &x, 4);
    return f;
}

#endif
