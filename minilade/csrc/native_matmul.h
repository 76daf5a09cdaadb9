// The weight matmuls of minilade_native_layer (native_layer.cpp): integer dot products over a copy of a w7a8
// weight's codes laid out for them (`MatmulCodes`), with no call into fbgemm.
//
// fbgemm's w7a8 call quantizes and packs its input, allocates buffers and runs a parallel region of its own at every
// call, and its kernel streamed a one-row step's weights at about 60% of the memory bandwidth a plain read reaches.
// `integer_matmul` reads each code once a pass, every row of a tile using it while it is in a register, from a layout
// in which a thread's share of a weight is one run of memory (asked for ahead of its reads by wide tiles); the rows of
// a tile are handed to it interleaved so that one load brings a quad of inputs of all of them. Whole passes of the demo
// model's layers (2 threads, AVX-512 VNNI) ran x0.95-x1.29 as fast as with fbgemm's call, more often faster the more
// rows (docs/benchmarks.md). Where the processor has matrix tiles (AMX) and they measure faster (use_matrix_tiles),
// `tile_block_sums` does a block's arithmetic for 16 rows at a time instead, from the same layout.
//
// The same bits as fbgemm's call, by construction: a row's sum of integer products is exact in any order (int32
// lanes, no saturation: on AVX2 a pair of u8 x s8 products is at most 2 x 255 x 63 = 32130, under the 16-bit bound,
// because the weight codes are 7-bit; a tile's sums are int32 too), and it becomes a float as fbgemm's
// requantization makes it one: float(sum - 128 x column sum) x weight scale (x an activation scale of 1, exact), then
// x the row's own scale as w7a8_linear applies it. tests/decoding/test_native_steps.py compares the two, bit for bit,
// at many row counts and shapes.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <sys/mman.h>

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(__AVX512VNNI__) || defined(__AVX2__)
#if defined(__AVX512VNNI__)
using Ints = __m512i;  // int32 lanes
constexpr int64_t kIntLanes = 16;
inline Ints zeros() { return _mm512_setzero_si512(); }
inline Ints load_ints(const void* p) { return _mm512_loadu_si512(p); }
inline Ints broadcast(const uint8_t* four) {
  int32_t v;
  std::memcpy(&v, four, 4);
  return _mm512_set1_epi32(v);
}
// Each int32 lane of acc plus the sum of its four u8 x s8 products, exactly.
inline Ints dot_add(Ints acc, Ints x, Ints w) { return _mm512_dpbusd_epi32(acc, x, w); }
inline Ints add(Ints a, Ints b) { return _mm512_add_epi32(a, b); }
inline void store_ints(int32_t* p, Ints v) { _mm512_storeu_si512(p, v); }
#else
using Ints = __m256i;
constexpr int64_t kIntLanes = 8;
inline Ints zeros() { return _mm256_setzero_si256(); }
inline Ints load_ints(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Ints broadcast(const uint8_t* four) {
  int32_t v;
  std::memcpy(&v, four, 4);
  return _mm256_set1_epi32(v);
}
// Pairs of u8 x s8 products in 16 bits (exact for 7-bit weight codes), then pairs of those in 32.
inline Ints dot_add(Ints acc, Ints x, Ints w) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), _mm256_set1_epi16(1)));
}
inline Ints add(Ints a, Ints b) { return _mm256_add_epi32(a, b); }
inline void store_ints(int32_t* p, Ints v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
#endif
constexpr bool kHasDotProducts = true;
#else
constexpr int64_t kIntLanes = 1;
constexpr bool kHasDotProducts = false;  // no integer dot products to write integer_matmul with: fbgemm's call serves
#endif

constexpr int64_t kVectors = 2;  // int vectors in a column block: a block is kVectors x kIntLanes output channels
// Rows that share each load of codes: kRowTile x kVectors accumulators in registers, with room for the codes and
// a row's inputs (32 vector registers on AVX-512, 16 on AVX2: 12 accumulators, two code vectors, a row's inputs and
// the second multiply's constant). On a Zen 3, tiles of 6 rows made 8-row passes of the demo model's layers and head
// some 5% faster than tiles of 4, and passes of 1-4 rows no slower.
constexpr int64_t kRowTile = kIntLanes == 16 ? 12 : 6;
// How far ahead of its reads a tile of at least kPrefetchRows rows asks for a block's codes. A tile of fewer rows
// reads them as fast as memory brings them, where the processor's own prefetching did as well or better alone (the
// layers' matmuls alone, an ad-hoc in-process comparison: one row 6-16% faster without, tiles of 12 rows 6% slower).
constexpr int64_t kPrefetchQuads = 16, kPrefetchRows = 8;

// Memory for codes that every pass reads whole (the demo model's: 135 MB a pass), in huge pages. Streamed through
// 4 KiB pages, a pass walks some 33,000 page translations and leaves the processor's translation caches holding its
// own; in 2 MiB pages it needs some 70. Laid-out codes go into chunks of 2 MiB-aligned memory advised to the kernel as
// huge pages (MADV_HUGEPAGE: Linux's transparent huge pages serve it unless they are off), a weight's codes a part of
// a chunk, so that small weights share huge pages. A chunk is freed once no tensor in it is left and the arena has
// moved on to another (the codes of a model forgotten meanwhile keep their place in the chunk being filled). Measured
// on the demo model (2-core Zen 3, plain steps alternating between two registrations of the same weights, one in 4 KiB
// pages, in one process): x1.065-x1.071 a step.
class HugePageArena {
 public:
  // An uninitialised int8 tensor of `sizes`, 64-byte aligned, in a huge-page chunk.
  at::Tensor codes(at::IntArrayRef sizes) {
    std::lock_guard<std::mutex> guard(lock_);
    const size_t n = static_cast<size_t>(c10::multiply_integers(sizes)), need = (n + kAlign - 1) / kAlign * kAlign;
    if (!chunk_ || chunk_->used + need > chunk_->size) chunk_ = std::make_shared<Chunk>(std::max(need, kChunk));
    std::shared_ptr<Chunk> chunk = chunk_;
    void* at = static_cast<char*>(chunk->base) + chunk->used;
    chunk->used += need;
    return at::from_blob(at, sizes, [chunk](void*) mutable { chunk.reset(); }, at::TensorOptions().dtype(at::kChar));
  }

 private:
  static constexpr size_t kHuge = size_t{2} << 20, kChunk = size_t{64} << 20, kAlign = 64;
  struct Chunk {
    void* base = nullptr;
    size_t size = 0, used = 0;
    explicit Chunk(size_t bytes) : size((bytes + kHuge - 1) / kHuge * kHuge) {
      TORCH_CHECK(posix_memalign(&base, kHuge, size) == 0, "native layer: out of memory for ", size, " bytes of codes");
#ifdef MADV_HUGEPAGE
      madvise(base, size, MADV_HUGEPAGE);  // advice only: 4 KiB pages where the kernel gives no huge ones
#endif
    }
    ~Chunk() { std::free(base); }
  };
  std::mutex lock_;
  std::shared_ptr<Chunk> chunk_;
};

inline HugePageArena& codes_arena() {
  static HugePageArena arena;
  return arena;
}

// A w7a8 weight's codes (N outputs x K inputs) for integer_matmul: columns in blocks of kVectors x kIntLanes, each
// block one run of memory over all of K (padded to a multiple of 4), holding for inputs 4q..4q+3 the four codes of
// each of its columns in turn: column c of block b, inputs 4q..4q+3, at codes[((b x K4 / 4 + q) x width + c) x 4].
struct MatmulCodes {
  at::Tensor codes;        // int8 (n_blocks, K4 / 4, width, 4), zero past K and N; undefined: not laid out here
  at::Tensor column_sums;  // (N,) int32: the sum of each output channel's codes
  at::Tensor scales;       // (N,) float32: each output channel's weight scale
  int64_t K = 0, K4 = 0, N = 0, n_blocks = 0;
  static constexpr int64_t width = kVectors * kIntLanes;
};

// A w7a8 weight's codes (N, K) int8, contiguous, and scales (N,) float32 laid out for integer_matmul, or an empty
// MatmulCodes where this build has no integer dot products to read them with (fbgemm's call then serves every pass).
// A block is written column by column, each column a row of the codes copied a quad of inputs at a time, its sum
// with it: no other copy of the weight is made (an output head's is tens of MB).
inline MatmulCodes matmul_codes(const at::Tensor& weight_codes, const at::Tensor& scales) {
  MatmulCodes laid_out;
  if (!kHasDotProducts) return laid_out;
  const int8_t* codes = weight_codes.const_data_ptr<int8_t>();
  const int64_t N = weight_codes.size(0), K = weight_codes.size(1), K4 = (K + 3) / 4 * 4, width = MatmulCodes::width;
  const int64_t n_blocks = (N + width - 1) / width, quads = K4 / 4;
  laid_out.codes = codes_arena().codes({n_blocks, quads, width, 4});
  laid_out.column_sums = at::empty({N}, at::kInt);
  int8_t* out = laid_out.codes.mutable_data_ptr<int8_t>();
  int32_t* column_sums = laid_out.column_sums.mutable_data_ptr<int32_t>();
  at::parallel_for(0, n_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      int8_t* block = out + b * quads * width * 4;
      std::memset(block, 0, quads * width * 4);  // zero past N and K
      for (int64_t c = 0; c < width && b * width + c < N; ++c) {  // one output channel: a row of the codes
        const int8_t* row = codes + (b * width + c) * K;
        int32_t sum = 0;
        for (int64_t k = 0; k < K; ++k) sum += row[k];
        column_sums[b * width + c] = sum;
        for (int64_t q = 0; q < K / 4; ++q) std::memcpy(block + (q * width + c) * 4, row + 4 * q, 4);
        if (K % 4) std::memcpy(block + (K / 4 * width + c) * 4, row + K / 4 * 4, K % 4);
      }
    }
  });
  laid_out.scales = scales.to(at::kFloat);
  laid_out.K = K, laid_out.K4 = K4, laid_out.N = N, laid_out.n_blocks = n_blocks;
  return laid_out;
}

// A tile of rows' activation codes as block_sums reads them: for inputs 4q..4q+3, the four u8 codes of each of the
// tile's rows in turn (row r's at (q x rows + r) x 4), so that one quad's codes of every row are one run of memory.
inline void interleave_quads(const uint8_t* x, int64_t rows, int64_t K4, uint8_t* tile) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t q = 0; q < K4 / 4; ++q) std::memcpy(tile + (q * rows + r) * 4, x + r * K4 + q * 4, 4);
}

#if defined(__AVX512VNNI__) || defined(__AVX2__)
// The int32 sums of a tile of RT rows (interleave_quads' layout) with the columns of block b, into sums (RT, width).
// Each quad's codes are loaded once for all RT rows; a single row keeps two accumulators a lane, even and odd quads,
// so that its additions do not wait on each other (an integer sum is the same in any order). The loops are unrolled
// so that the accumulators stay in registers.
template <int RT>
void block_sums(const MatmulCodes& w, int64_t b, const uint8_t* tile, int32_t* sums) {
  constexpr int V = kVectors, S = RT == 1 ? 2 : 1;
  Ints acc[S * RT][V];
#pragma GCC unroll 32
  for (int a = 0; a < S * RT; ++a)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[a][v] = zeros();
  const int64_t quads = w.K4 / 4, quad_bytes = MatmulCodes::width * 4;
  const int8_t* codes = w.codes.const_data_ptr<int8_t>() + b * quads * quad_bytes;
  for (int64_t q = 0; q < quads; ++q) {
    const int8_t* at = codes + q * quad_bytes;
    const uint8_t* xq = tile + q * RT * 4;
    const int set = S == 1 ? 0 : static_cast<int>(q & 1) * RT;
    Ints wv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      if constexpr (RT >= kPrefetchRows) {
        _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchQuads * quad_bytes + v * kIntLanes * 4), _MM_HINT_T0);
      }
      wv[v] = load_ints(at + v * kIntLanes * 4);
    }
#pragma GCC unroll 32
    for (int r = 0; r < RT; ++r) {
      const Ints xb = broadcast(xq + r * 4);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[set + r][v] = dot_add(acc[set + r][v], xb, wv[v]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < RT; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const Ints total = S == 1 ? acc[r][v] : add(acc[r][v], acc[RT + r][v]);
      store_ints(sums + r * MatmulCodes::width + v * kIntLanes, total);
    }
  }
}

using BlockSums = void (*)(const MatmulCodes&, int64_t, const uint8_t*, int32_t*);

template <int... RT>
constexpr std::array<BlockSums, sizeof...(RT)> block_sums_by_rows(std::integer_sequence<int, RT...>) {
  return {block_sums<RT + 1>...};
}

// kBlockSums[rows - 1]: block_sums for a tile of `rows` rows, 1 to kRowTile.
constexpr auto kBlockSums = block_sums_by_rows(std::make_integer_sequence<int, kRowTile>());
#endif

// Rows [r0, r0 + rows) of y from their int32 sums with the columns of block b (sums (rows, width)): each becomes a
// float as fbgemm's requantization makes it one, then x the row's own scale.
inline void write_block(const MatmulCodes& w, int64_t b, const int32_t* sums, int64_t r0, int64_t rows,
                        const float* row_scales, float* y) {
  const int32_t* column_sums = w.column_sums.const_data_ptr<int32_t>();
  const float* scales = w.scales.const_data_ptr<float>();
  const int64_t n0 = b * MatmulCodes::width, columns = std::min(MatmulCodes::width, w.N - n0);
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict out = y + (r0 + r) * w.N + n0;
    const int32_t* __restrict row_sums = sums + r * MatmulCodes::width;
    const float row_scale = row_scales[r0 + r];
    for (int64_t c = 0; c < columns; ++c) {
      const int32_t sum = row_sums[c] - 128 * column_sums[n0 + c];
      out[c] = static_cast<float>(sum) * scales[n0 + c] * row_scale;
    }
  }
}

// Matrix tiles (AMX): the processor multiplies a tile of 16 rows x 64 u8 inputs by one of 16 quads x 16 columns of
// s8 codes into 16 x 16 int32 sums in one instruction (tdpbusd), each sum exact, as vpdpbusd's. A block's codes are
// already a tile's layout: quad q of its columns 0-15 is 64 bytes at the start of its 128-byte run, columns 16-31 the
// next 64. Where many rows share a step this does their arithmetic for a fraction of the vector loop's time; the sums
// and so the bits are the same.
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
constexpr bool kHasMatrixTiles = true;
constexpr int64_t kTileRows = 16, kTileQuads = 16;
// Fewer rows go to the vector loop: a matmul of one or two rows waits on reading the codes either way, and on tiles
// it measured the same or up to a tenth slower (scripts/bench/native_matmul.py on an AMX Xeon), from 4 rows faster.
constexpr int64_t kTileMinRows = 4;
static_assert(MatmulCodes::width == 32, "a block is two tiles of 16 columns");

// Whether Linux lets this process use tile data: it asks each process to request it once (else tile instructions
// fault).
inline bool matrix_tiles_granted() {
  static const bool granted = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

// The tiles' shapes, as ldtilecfg reads them: 0-1 the sums of 16 rows with a block's two halves, 2 a tile of inputs,
// 3-4 the halves' codes for 16 quads; 5-7 the same for the quads past the last whole 16 (none where K4 / 4 is a
// multiple of 16).
struct alignas(64) TileShapes {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};

  explicit TileShapes(int64_t tail_quads) {
    for (int t : {0, 1, 2, 3, 4}) bytes_per_row[t] = 64, rows[t] = kTileRows;
    rows[3] = rows[4] = kTileQuads;
    if (tail_quads > 0) {
      bytes_per_row[5] = static_cast<uint16_t>(tail_quads * 4), rows[5] = kTileRows;
      for (int t : {6, 7}) bytes_per_row[t] = 64, rows[t] = static_cast<uint8_t>(tail_quads);
    }
  }
};

// The int32 sums of 16 rows of inputs (u8, one row every `stride` bytes) with the columns of block b, into sums
// (16, width); the tile shapes must be loaded (TileShapes(quads % 16)). The whole chunks of 16 quads and the last
// part chunk go through tiles of their own shapes; GCC's tile intrinsics spell the tile number into the
// instruction's text, so the two are written out rather than shared through a template.
inline void tile_block_sums(const MatmulCodes& w, int64_t b, const uint8_t* inputs, int64_t stride, int32_t* sums) {
  const int64_t quads = w.K4 / 4, quad_bytes = MatmulCodes::width * 4, whole = quads / kTileQuads;
  const int8_t* codes = w.codes.const_data_ptr<int8_t>() + b * quads * quad_bytes;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t chunk = 0; chunk < whole; ++chunk) {
    const int8_t* at = codes + chunk * kTileQuads * quad_bytes;
    _tile_loadd(2, inputs + chunk * kTileQuads * 4, stride);
    _tile_loadd(3, at, quad_bytes);
    _tile_loadd(4, at + 64, quad_bytes);
    _tile_dpbusd(0, 2, 3);
    _tile_dpbusd(1, 2, 4);
  }
  if (quads % kTileQuads != 0) {
    const int8_t* at = codes + whole * kTileQuads * quad_bytes;
    _tile_loadd(5, inputs + whole * kTileQuads * 4, stride);
    _tile_loadd(6, at, quad_bytes);
    _tile_loadd(7, at + 64, quad_bytes);
    _tile_dpbusd(0, 5, 6);
    _tile_dpbusd(1, 5, 7);
  }
  _tile_stored(0, sums, quad_bytes);
  _tile_stored(1, sums + 16, quad_bytes);
}
#else
constexpr bool kHasMatrixTiles = false;
inline bool matrix_tiles_granted() { return false; }
#endif

// Whether matmuls take matrix tiles where the processor has them (use_matrix_tiles: where measured faster; the sums,
// and so the bits, are the same either way).
inline std::atomic<bool>& matrix_tiles_on() {
  static std::atomic<bool> on{false};
  return on;
}

// y (R, N) float32 = the w7a8 matmul of R rows of 8-bit codes: x (R, K4) u8, each code + 128 (fbgemm's zero point),
// zero from K to K4; row_scales (R,) each row's activation scale. Threads take column blocks, and a block's codes are
// read from memory once, for the first tile of rows, and from the cache for the others. The rows go in tiles of 16 to
// matrix tiles where they are on (matrix_tiles_on) and at least kTileMinRows, else in tiles of kRowTile to the vector
// loop (interleave_quads).
inline void integer_matmul(const MatmulCodes& w, const uint8_t* x, int64_t R, const float* row_scales, float* y) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  if (R >= kTileMinRows && matrix_tiles_on().load(std::memory_order_relaxed) && matrix_tiles_granted()) {
    const int64_t row_tiles = (R + kTileRows - 1) / kTileRows;
    std::vector<uint8_t> padded(row_tiles * kTileRows * w.K4, 0);  // rows past R zero
    std::memcpy(padded.data(), x, R * w.K4);
    at::parallel_for(0, w.n_blocks, 1, [&](int64_t begin, int64_t end) {
      const TileShapes shapes(w.K4 / 4 % kTileQuads);
      _tile_loadconfig(&shapes);
      alignas(64) int32_t sums[kTileRows * MatmulCodes::width];
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t t = 0; t < row_tiles; ++t) {
          tile_block_sums(w, b, padded.data() + t * kTileRows * w.K4, w.K4, sums);
          write_block(w, b, sums, t * kTileRows, std::min(kTileRows, R - t * kTileRows), row_scales, y);
        }
      }
      _tile_release();
    });
    return;
  }
#endif
#if defined(__AVX512VNNI__) || defined(__AVX2__)
  std::vector<uint8_t> tiles(R * w.K4);
  for (int64_t r0 = 0; r0 < R; r0 += kRowTile) {
    interleave_quads(x + r0 * w.K4, std::min(kRowTile, R - r0), w.K4, tiles.data() + r0 * w.K4);
  }
  at::parallel_for(0, w.n_blocks, 1, [&](int64_t begin, int64_t end) {
    int32_t sums[kRowTile * MatmulCodes::width];
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r0 = 0; r0 < R; r0 += kRowTile) {
        const int64_t rows = std::min(kRowTile, R - r0);
        kBlockSums[rows - 1](w, b, tiles.data() + r0 * w.K4, sums);
        write_block(w, b, sums, r0, rows, row_scales, y);
      }
    }
  });
#else
  TORCH_CHECK(false, "native layer: no integer dot products to compute w7a8 matmuls with");
#endif
}

}  // namespace
