// The row pass of column_filter (filter_rows), included by column_filter.cpp once per instruction
// set, inside that set's MK_ISA_BEGIN region and namespace (isa.h: GCC compiles a function for the
// target of the region it is parsed in). The includer defines kChunk and
// chunk_mask(const float* x, const float* lo) -> uint32_t: bit c set iff !(x[c] < lo[c]), for
// c < kChunk; this defines filter_rows_variant, filter_rows for that set.
//
// A row's candidate bits are gathered 64 columns to a word before its candidates are appended, so
// the append loop's unpredictable exit costs one mispredicted branch per loop, not one per chunk;
// and two words (two rows at E = 64) share one loop, which takes the first word's bits, then the
// second's, by conditional moves: one exit per two words. (Flattening a block of rows' bits into
// positions first, a fixed number of steps per row, measured slower: the extra work per row cost
// more than the branch; so did 3 to 6 branch-free appends per row and word, into a sink list,
// before the loop for the rest.) An append stores the score's bits, not its order key, whose NaN
// test was a branch here. All w columns of a row are filtered in one pass: a pass per slice of the
// rows (256 of every 1024 bytes, say) read at a fraction of the bandwidth.
//
// Appends go through a pointer per column (lists.cursor). Rows run in blocks: a block whose rows
// cannot overflow any list (each column has room for one append per row) appends with no capacity
// test; any other block appends while its lists have room and counts the rest (lists.overflow).
namespace {

// One word of candidate bits: columns c0 + (set bits) of the row at `row` (token t).
struct FilterWord {
  uint64_t bits;
  const float* row;  // the row's first column (bit b is row[c0 + b])
  int64_t c0;
  uint64_t t;
};

template <bool kRoom>
MK_ALWAYS_INLINE void filter_append(CandidateLists& lists, int64_t j, float v, uint64_t t) {
  uint64_t*& cursor = lists.cursor[j];
  if (!kRoom && cursor == lists.entries.get() + j * lists.ld + lists.capacity) {
    ++lists.overflow[j];
    return;
  }
  *cursor++ = (uint64_t)float_bits(v) << 32 | t;
}

// The candidates of words a and b, a's first: one loop, whose every step takes the lowest bit of a
// while a has one, else b's (selects, not branches).
template <bool kRoom>
MK_ALWAYS_INLINE void filter_pair(CandidateLists& lists, FilterWord a, FilterWord b) {
  while (a.bits | b.bits) {
    const bool first = a.bits != 0;
    const uint64_t bits = first ? a.bits : b.bits;
    const int64_t c = first ? a.c0 : b.c0;
    const float* row = first ? a.row : b.row;
    const uint64_t t = first ? a.t : b.t;
    const int64_t j = c + __builtin_ctzll(bits);
    a.bits &= a.bits - 1;  // 0 stays 0 once a is done
    b.bits = first ? b.bits : b.bits & (b.bits - 1);
    filter_append<kRoom>(lists, j, row[j], t);
  }
}

// The word of columns [c0, c1) (c1 - c0 <= 64) of one row.
template <int64_t kWidth>
MK_ALWAYS_INLINE uint64_t filter_word(const float* row, const float* lo, int64_t c0, int64_t c1) {
  uint64_t bits = 0;
  if constexpr (kWidth == 64 && 64 % kChunk == 0) {
    for (int64_t c = 0; c < 64; c += kChunk) bits |= (uint64_t)chunk_mask(row + c, lo + c) << c;
    return bits;
  }
  int64_t c = c0;
  for (; c + kChunk <= c1; c += kChunk) bits |= (uint64_t)chunk_mask(row + c, lo + c) << (c - c0);
  for (; c < c1; ++c) bits |= (uint64_t)!(row[c] < lo[c]) << (c - c0);
  return bits;
}

// Rows [r0, r1) of x (token t0 + r), kWidth = w when it is 64 (one word a row), else 0.
template <bool kRoom, int64_t kWidth>
void filter_block(const float* x, int64_t stride_t, int64_t t0, int64_t r0, int64_t r1, const float* lo,
                  CandidateLists& lists) {
  const int64_t w = kWidth ? kWidth : lists.w;
  FilterWord pending{0, nullptr, 0, 0};
  bool held = false;
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = x + r * stride_t;
    for (int64_t c0 = 0; c0 < w; c0 += 64) {
      const FilterWord word{filter_word<kWidth>(row, lo, c0, std::min<int64_t>(w, c0 + 64)), row, c0,
                            (uint64_t)(t0 + r)};
      if (held) filter_pair<kRoom>(lists, pending, word);
      pending = word;
      held = !held;
    }
  }
  if (held) filter_pair<kRoom>(lists, pending, FilterWord{0, nullptr, 0, 0});
}

template <int64_t kWidth>
void filter_rows_width(const float* x, int64_t stride_t, int64_t t0, int64_t rows, const float* lo,
                       CandidateLists& lists) {
  constexpr int64_t kBlock = 256;
  const int64_t w = lists.w;
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    const int64_t r1 = std::min(rows, r0 + kBlock);
    bool room = true;
    for (int64_t j = 0; j < w; ++j)
      room &= (lists.entries.get() + j * lists.ld + lists.capacity) - lists.cursor[j] >= r1 - r0;
    if (room)
      filter_block<true, kWidth>(x, stride_t, t0, r0, r1, lo, lists);
    else
      filter_block<false, kWidth>(x, stride_t, t0, r0, r1, lo, lists);
  }
}

}  // namespace

void filter_rows_variant(const float* x, int64_t stride_t, int64_t t0, int64_t rows, const float* lo,
                         CandidateLists& lists) {
  lists.begin_appends();
  if (lists.w == 64)
    filter_rows_width<64>(x, stride_t, t0, rows, lo, lists);
  else
    filter_rows_width<0>(x, stride_t, t0, rows, lo, lists);
  lists.end_appends();
}
