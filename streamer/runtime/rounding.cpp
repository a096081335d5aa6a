// A bf16 master's stochastic rounding on the CPU (optim.py's `stochastic_round_bf16_`), one vectorized pass.
//
// Each element's 16 random bits are lowbias32 of its index within the unit (mod 2^32) XOR the unit's key, as
// optim.py's `random_bits16` draws them, with its multipliers; they are added below bf16's mantissa and
// truncated. Unsigned 32-bit arithmetic wraps as the int32 tensors' does, so the bits are the torch kernels'.
//
// Call order: none; each call is independent. `threads` OpenMP threads split a call's elements.
#include <cstdint>

extern "C" {

// Round the fp32 `values`, elements [start, start + numel) of their unit (mod 2^32), in place to bf16 values.
void ws_round_bf16(float* values, int64_t numel, uint32_t start, uint32_t key, uint32_t multiplier0,
                   uint32_t multiplier1, int threads) {
  uint32_t* bits = reinterpret_cast<uint32_t*>(values);
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < numel; ++i) {
    uint32_t x = (static_cast<uint32_t>(i) + start) ^ key;
    x = (x ^ (x >> 16)) * multiplier0;
    x = (x ^ (x >> 15)) * multiplier1;
    x = x ^ (x >> 15);
    bits[i] = (bits[i] + (x >> 16)) & 0xFFFF0000u;
  }
}

}  // extern "C"
