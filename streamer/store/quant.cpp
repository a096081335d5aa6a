// Block-wise 8-bit quantization of Adam's moments on the CPU (quant.py's format and codes), one pass per block.
//
// A block's record is its fp32 scale, then one code a value. Encoding takes the block's absolute maximum, divides
// each value by it and looks its code up by the quotient's top 16 bits in one table: per 16-bit range of fp32
// values, the code below which the range starts (bits 0-7), whether the next code's midpoint lies inside the
// range (bit 8) and that midpoint's low 16 bits (bits 16-31). Inside one range the top bits are equal, so a
// value reaches the midpoint where its low bits do (the other way round for negative values, whose bits grow as
// they fall). These are the codes of quant.py's two-table kernel, bit for bit, and its scales (the same fp32
// maximum and division); only a NaN's payload may differ.
//
// Call order: none; each call is independent. `threads` OpenMP threads split a call's blocks.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int LANES = 16;  // independent running maxima, so that the block's maximum vectorizes
constexpr int SCALE_BYTES = 4;

int64_t block_count(int64_t numel, int64_t block) { return (numel + block - 1) / block; }

int64_t block_numel(int64_t b, int64_t numel, int64_t block) {
  return (b + 1) * block <= numel ? block : numel - b * block;
}

// The block's absolute maximum, floored at `min_scale`, or NaN where a value is NaN (as torch's amax and clamp).
float block_scale(const float* v, int64_t n, float min_scale) {
  float lanes[LANES] = {0.0f};
  int nan = 0;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
#pragma omp simd reduction(| : nan)
    for (int j = 0; j < LANES; ++j) {
      const float a = std::fabs(v[i + j]);
      nan |= a != a;
      lanes[j] = a > lanes[j] ? a : lanes[j];
    }
  }
  float amax = 0.0f;
  for (; i < n; ++i) {
    const float a = std::fabs(v[i]);
    nan |= a != a;
    amax = a > amax ? a : amax;
  }
  for (float lane : lanes) amax = lane > amax ? lane : amax;
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  return amax < min_scale ? min_scale : amax;
}

}  // namespace

extern "C" {

// Quantize `numel` fp32 `values` into `out`: one record per `block` values (a partial last block has fewer codes).
void ws_encode(const float* values, int64_t numel, int64_t block, float min_scale, const uint32_t* table,
               uint8_t* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < block_count(numel, block); ++b) {
    const float* v = values + b * block;
    const int64_t n = block_numel(b, numel, block);
    uint8_t* record = out + b * (block + SCALE_BYTES);
    const float scale = block_scale(v, n, min_scale);
    std::memcpy(record, &scale, SCALE_BYTES);
    uint8_t* codes = record + SCALE_BYTES;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float normed = v[i] / scale;
      uint32_t bits;
      std::memcpy(&bits, &normed, sizeof bits);
      const uint32_t entry = table[(bits >> 16) ^ 0x8000u];  // the int16 top bits + 2^15
      const uint32_t low = bits & 0xFFFFu, mid = entry >> 16;
      const uint32_t reaches = (bits >> 31) ? (low <= mid) : (low >= mid);
      codes[i] = static_cast<uint8_t>((entry & 0xFFu) + ((entry >> 8) & reaches & 1u));
    }
  }
}

// Dequantize the records `raw` of `numel` values into `out` (fp32): each code's value under its block's scale.
void ws_decode(const uint8_t* raw, int64_t numel, int64_t block, const float* qmap, float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < block_count(numel, block); ++b) {
    const uint8_t* record = raw + b * (block + SCALE_BYTES);
    float scale;
    std::memcpy(&scale, record, SCALE_BYTES);
    const uint8_t* codes = record + SCALE_BYTES;
    float* o = out + b * block;
    const int64_t n = block_numel(b, numel, block);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] = qmap[codes[i]] * scale;
  }
}

}  // extern "C"
