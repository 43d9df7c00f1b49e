// The drivers' random numbers: xorshift64, the same sequence on every machine and compiler.
#pragma once
#include <cstdint>

namespace {

uint64_t state = 0x9e3779b97f4a7c15ULL;
uint64_t next() {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return state;
}
float uniform() { return (float)(next() >> 40) / (float)(1 << 24); }  // [0, 1)

}  // namespace
