/* Fused fp32 CPU kernels for a Llama-family decoder layer's element-wise parts (rlaif/models/cpu_kernels.py builds
 * this file with the machine's C compiler and calls it through ctypes). Eager PyTorch runs each of these as 4-12
 * separate passes over memory; here each is one pass forward and one backward.
 *
 * Every result is the same bits whatever the thread count and wherever a row sits in memory: sums run in a fixed
 * order (16 lanes, then the lanes in order), the RMSNorm weight gradient is summed per block of BLOCK rows and the
 * blocks in order. IEEE arithmetic (no -ffast-math); only expf is the C library's vector version. */
#include <math.h>
#include <stdint.h>

/* glibc's vector expf (libmvec), declared as math-vector.h declares it under -ffast-math. */
__attribute__((__simd__("notinbranch"))) float expf(float);

#define LANES 16
#define BLOCK 32

static float dot(const float *a, const float *b, int64_t n) {
  float lanes[LANES] = {0};
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int k = 0; k < LANES; k++) lanes[k] += a[j + k] * b[j + k];
  float sum = 0.f;
  for (int k = 0; k < LANES; k++) sum += lanes[k];
  for (; j < n; j++) sum += a[j] * b[j];
  return sum;
}

/* y = weight * (x * rstd), rstd = 1 / sqrt(mean(x^2) + eps), per row of width h; rstd kept for the backward. */
void rms_norm_forward(const float *x, const float *weight, float *y, float *rstd, int64_t rows, int64_t h,
                      float eps, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * h;
    float *yr = y + r * h;
    float inv = 1.f / sqrtf(dot(xr, xr, h) / (float)h + eps);
    rstd[r] = inv;
    for (int64_t j = 0; j < h; j++) yr[j] = weight[j] * (xr[j] * inv);
  }
}

/* dx = rstd * dy * weight - x * rstd^3 * mean(dy * weight * x); dweight (where not NULL: a frozen weight needs
 * none) = sum over rows of dy * x * rstd, summed per block of rows into `partial` [blocks, h], then over the blocks
 * in order. */
void rms_norm_backward(const float *dy, const float *x, const float *weight, const float *rstd, float *dx,
                       float *partial, float *dweight, int64_t rows, int64_t h, int threads) {
  int64_t blocks = (rows + BLOCK - 1) / BLOCK;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    float *part = partial + b * h;
    int64_t end = (b + 1) * BLOCK < rows ? (b + 1) * BLOCK : rows;
    if (dweight)
      for (int64_t j = 0; j < h; j++) part[j] = 0.f;
    for (int64_t r = b * BLOCK; r < end; r++) {
      const float *dyr = dy + r * h, *xr = x + r * h;
      float *dxr = dx + r * h;
      float inv = rstd[r];
      for (int64_t j = 0; j < h; j++) dxr[j] = dyr[j] * weight[j];  /* dy * weight, before dx overwrites it */
      float scale = dot(dxr, xr, h) * inv * inv * inv / (float)h;
      if (dweight)
        for (int64_t j = 0; j < h; j++) part[j] += dyr[j] * (xr[j] * inv);
      for (int64_t j = 0; j < h; j++) dxr[j] = inv * dxr[j] - scale * xr[j];
    }
  }
  if (!dweight) return;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t j = 0; j < h; j++) {
    float sum = 0.f;
    for (int64_t b = 0; b < blocks; b++) sum += partial[b * h + j];
    dweight[j] = sum;
  }
}

/* out = silu(gate) * up over n elements. */
void swiglu_forward(const float *gate, const float *up, float *out, int64_t n, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i++) out[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
}

/* dgate = dout * up * s * (1 + gate * (1 - s)), dup = dout * silu(gate), s = sigmoid(gate). */
void swiglu_backward(const float *dout, const float *gate, const float *up, float *dgate, float *dup, int64_t n,
                     int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    float g = gate[i], s = 1.f / (1.f + expf(-g)), d = dout[i];
    dup[i] = d * (g * s);
    dgate[i] = d * up[i] * (s * (1.f + g * (1.f - s)));
  }
}

/* Rotary embedding of x [tokens, heads, d] with cos/sin [tokens, d] (one row per token, shared by its heads):
 * out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[d/2:], x[:d/2]). With sign = -1 it is the backward:
 * dx = dout * cos + rotate_half^T(dout * sin), rotate_half^T(v) = cat(v[d/2:], -v[:d/2]). */
void rotary(const float *x, const float *cos, const float *sin, float *out, int64_t tokens, int64_t heads, int64_t d,
            int backward, int threads) {
  int64_t half = d / 2;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tokens; t++) {
    const float *c = cos + t * d, *s = sin + t * d;
    for (int64_t hd = 0; hd < heads; hd++) {
      const float *xr = x + (t * heads + hd) * d;
      float *o = out + (t * heads + hd) * d;
      if (!backward) {
        for (int64_t j = 0; j < half; j++) o[j] = xr[j] * c[j] - xr[j + half] * s[j];
        for (int64_t j = half; j < d; j++) o[j] = xr[j] * c[j] + xr[j - half] * s[j];
      } else {
        for (int64_t j = 0; j < half; j++) o[j] = xr[j] * c[j] + xr[j + half] * s[j + half];
        for (int64_t j = half; j < d; j++) o[j] = xr[j] * c[j] - xr[j - half] * s[j - half];
      }
    }
  }
}
