// Every kernel source but the attention one, compiled as one translation unit: parsing ATen's headers costs
// ~15 s per unit on 2 cores, more than most of these files' own code, and the build (once per instruction set)
// ran 8 units. Two units (this one and paged_attention_cpu.cpp, the largest) build in parallel in about half
// the time. Each file keeps its own namespace (llmopt_cpu::fused, ::int4, ::int8 (also int8_q8_cpu.cpp), ::fp4,
// ::sparse24, ::sparse_bitmask, ::comm, ::graph).
#include "fused_cpu.cpp"
#include "int4_cpu.cpp"
#include "int4_q8_cpu.cpp"
#include "int8_q8_cpu.cpp"  // after int4_q8_cpu.cpp: the same 8-bit inputs (int4::quantize_inputs)
#include "int8_cpu.cpp"
#include "int8_weight_cpu.cpp"
#include "fp4_cpu.cpp"
#include "sparse24_cpu.cpp"
#include "sparse_bitmask_cpu.cpp"
#include "shm_all_reduce.cpp"
#include "decode_graph_cpu.cpp"  // after every kernel it calls; its class is registered in register.cpp
#include "register.cpp"
