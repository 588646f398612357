/* Fused fp32 CPU kernels for a Llama-family decoder layer's element-wise parts (rlaif/models/cpu_kernels.py builds
 * this file with the machine's C compiler and calls it through ctypes). Eager PyTorch runs each of these as 4-12
 * separate passes over memory; here each is one pass forward and one backward.
 *
 * Every result is the same bits whatever the thread count and wherever a row sits in memory or in its batch: plain
 * IEEE arithmetic (built without -ffast-math and with -ffp-contract=off, so a loop's vector body and its scalar tail
 * compute alike), sums in a fixed order (16 lanes, then the lanes in order), the RMSNorm weight gradient summed per
 * block of rows and the blocks in order, and exp as an inline polynomial (a C library's vector and scalar expf differ
 * in the last bit). The rotary embedding computes exactly what transformers' apply_rotary_pos_emb computes. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

/* e^x for the sigmoid, within 2 ulp of expf over [-87.3, 88] (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a
 * degree-6 polynomial in r, 2^n from the exponent bits); x is clamped to that range, NaN stays NaN. */
static inline float exp_clamped(float x) {
  x = x > 88.0f ? 88.0f : x;
  x = x < -87.3f ? -87.3f : x;
  /* n = round(x / ln2): adding and subtracting 1.5 * 2^23 rounds to an integer in two IEEE operations, which
   * vectorize where floorf (a library call without -ffast-math) would not */
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

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
 * none) = sum over rows of dy * x * rstd, summed per `block` rows into `partial` [ceil(rows / block), h], then
 * over the blocks in order. */
void rms_norm_backward(const float *dy, const float *x, const float *weight, const float *rstd, float *dx,
                       float *partial, float *dweight, int64_t rows, int64_t h, int64_t block, int threads) {
  int64_t blocks = (rows + block - 1) / block;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    float *part = partial + b * h;
    int64_t end = (b + 1) * block < rows ? (b + 1) * block : rows;
    if (dweight)
      for (int64_t j = 0; j < h; j++) part[j] = 0.f;
    for (int64_t r = b * block; r < end; r++) {
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
  for (int64_t i = 0; i < n; i++) out[i] = gate[i] / (1.f + exp_clamped(-gate[i])) * up[i];
}

/* dgate = dout * up * s * (1 + gate * (1 - s)), dup = dout * silu(gate), s = sigmoid(gate). */
void swiglu_backward(const float *dout, const float *gate, const float *up, float *dgate, float *dup, int64_t n,
                     int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    float g = gate[i], s = 1.f / (1.f + exp_clamped(-g)), d = dout[i];
    dup[i] = d * (g * s);
    dgate[i] = d * up[i] * (s * (1.f + g * (1.f - s)));
  }
}

/* Rotary embedding of x [tokens, heads, d] with cos/sin [tokens, d], one row per token shared by its heads (with
 * `shared_rows` > 0: one row per position of a sequence of that length, shared by every sequence of the batch):
 * out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[d/2:], x[:d/2]). With `backward` set:
 * dx = dout * cos + rotate_half^T(dout * sin), rotate_half^T(v) = cat(v[d/2:], -v[:d/2]). */
void rotary(const float *x, const float *cos, const float *sin, float *out, int64_t tokens, int64_t heads, int64_t d,
            int64_t shared_rows, int backward, int threads) {
  int64_t half = d / 2;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tokens; t++) {
    int64_t row = shared_rows > 0 ? t % shared_rows : t;
    const float *c = cos + row * d, *s = sin + row * d;
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
