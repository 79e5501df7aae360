/* kvlm's C kernels, compiled as one translation unit: this file includes the parts in
 * order and is the only file the compiler is given (kvlm.kernels; its build key hashes it
 * and every file it includes), so each function sees the others and the compiler inlines
 * across the parts as it would within one file. The parts (each compiled only through
 * here; a later part uses what the earlier ones define):
 *   abi.h       the binary interface with Python: the structs the decode step is handed,
 *               the weight kinds, K/V dtypes and activation bits, the limits, the ABI number
 *   base.c      the system headers and KVLM_V512 (v512.h: the AVX-512 names on AVX2), the
 *               checks of the sizes an entry point is given, fp16 / bf16 conversions, the
 *               shared vector math, what the build is (kvlm_kernel_abi, _simd, _vnni)
 *   weights.c   the weight formats and their packed layout; products on fp32, int8 and
 *               int16 activations (kvlm_qgemm, kvlm_qgemm_i8), dequantization
 *               (kvlm_qdequant, kvlm_qdequant_rows), packing (kvlm_qpack)
 *   kv.c        the K/V cache as the decode step reads it, what every dtype shares: row
 *               bytes, where a KV head's rows lie (kv_span), prefetching, softmax pieces
 *   kv_float.c  fp32, bf16 and fp16 K/V: scores and p.V (kvlm_f16_round_trip)
 *   kv_int8.c   int8 K/V: the row quantizer, integer scores, p.V (kvlm_quantize_kv_rows)
 *   kv_q4.c     q4 K/V: the row quantizer, grouped integer scores, p.V
 *               (kvlm_quantize_q4_rows)
 *   conv.c      the short convolution's decode rows (the conv layer kind): the gated taps
 *               over a sequence's held rows and the step's, the rows moved on after it
 *   deltanet.c  the gated DeltaNet's step after its convolution (the deltanet layer kind):
 *               silu, the q/k norms, the gates, the delta rule's state, the gated norm
 *               (kvlm_gated_delta), a value one way wherever it falls in a step
 *   mamba2.c    the Mamba2 layer's step after its convolution (the mamba2 layer kind):
 *               silu, dt, the selective state, D, the gate and the group norm
 *               (kvlm_mamba2), with deltanet.c's row helpers
 *   decode.c    the fused decode step (kvlm_decode_scratch, kvlm_decode_batch)
 *   prompt.c    the prompt's ops: SwiGLU (kvlm_silu_mul), RMSNorm (kvlm_rms_norm), q/k norm
 *               and RoPE (kvlm_qk_norm_rope), attention (kvlm_attend)
 * A new layer kind's kernels are a part of their own, included before decode.c. */
#include "abi.h"
#include "base.c"
#include "weights.c"
#include "kv.c"
#include "kv_float.c"
#include "kv_int8.c"
#include "kv_q4.c"
#include "conv.c"
#include "deltanet.c"
#include "mamba2.c"
#include "experts.c"
#include "decode.c"
#include "prompt.c"
