/* How long one zmm multiply-add instruction takes on this CPU, per kind: fp32 FMA (16
 * multiply-adds), vdpbf16ps (32, bf16 pairs), vpdpwssd (32, int16 pairs), vpdpbusd (64, u8 x
 * s8 fours); 12 independent accumulators each, so throughput, not latency, is timed.
 * Needs AVX512-BF16 and AVX512-VNNI (docs/BENCHMARKS.md 19.4):
 *     gcc -O2 -march=native benchmarks/vector_ops.c -o /tmp/vector_ops && /tmp/vector_ops */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  const long N=200000000;
  __m512 a[12]; for(int i=0;i<12;i++) a[i]=_mm512_set1_ps(i*1e-9f);
  __m512 x=_mm512_set1_ps(1.0001f), y=_mm512_set1_ps(0.9999f);
  double t=now();
  for(long n=0;n<N/12;n++){ for(int i=0;i<12;i++) a[i]=_mm512_fmadd_ps(x,y,a[i]); __asm__ volatile(""::"v"(x)); }
  double fma=now()-t;
  __m512 b[12]; for(int i=0;i<12;i++) b[i]=_mm512_set1_ps(i*1e-9f);
  __m512bh xb=(__m512bh)_mm512_set1_epi32(0x3f803f80), yb=(__m512bh)_mm512_set1_epi32(0x3f803f80);
  t=now();
  for(long n=0;n<N/12;n++){ for(int i=0;i<12;i++) b[i]=_mm512_dpbf16_ps(b[i],xb,yb); __asm__ volatile(""::"v"(xb)); }
  double bf=now()-t;
  __m512i c[12]; for(int i=0;i<12;i++) c[i]=_mm512_set1_epi32(i);
  __m512i xi=_mm512_set1_epi32(0x01010101), yi=_mm512_set1_epi32(0x01010101);
  t=now();
  for(long n=0;n<N/12;n++){ for(int i=0;i<12;i++) c[i]=_mm512_dpwssd_epi32(c[i],xi,yi); __asm__ volatile(""::"v"(xi)); }
  double ws=now()-t;
  t=now();
  for(long n=0;n<N/12;n++){ for(int i=0;i<12;i++) c[i]=_mm512_dpbusd_epi32(c[i],xi,yi); __asm__ volatile(""::"v"(xi)); }
  double bu=now()-t;
  float s=0; for(int i=0;i<12;i++) s+=_mm512_reduce_add_ps(a[i])+_mm512_reduce_add_ps(b[i])+_mm512_reduce_add_epi32(c[i]);
  printf("per instr ns: fma %.3f dpbf16 %.3f dpwssd %.3f dpbusd %.3f (%g)\n", fma/N*1e9, bf/N*1e9, ws/N*1e9, bu/N*1e9, s);
}
