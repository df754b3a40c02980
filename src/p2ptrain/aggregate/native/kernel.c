/*
 * One streamed pass of an aggregation rule, in C: optionally the aggregate itself -- the
 * weighted combination of chosen rows (float32, a separate multiply and add per row, in the
 * given order) or the coordinate-wise trimmed mean (rules_basic.TrimmedSpans: the same
 * sorting network, adds in rank order, one division) -- then the
 * float64 squared distance from every row to the aggregate, summed in exactly the tree of
 * p2ptrain.aggregate.rules_basic.RowSums. The Python side (native/__init__.py) owns the
 * contract; this file must give the same bits as the torch code it replaces:
 *
 *   - every float32 operation is one IEEE-754 rounding (no contraction: -ffp-contract=off,
 *     never -ffast-math), so vector width and compiler do not change a single bit;
 *   - a difference is rounded once to float32 and squared exactly in float64;
 *   - each CHUNK block of squares is halved (x[i] += x[i + h]) down to `tail` values. Down
 *     to `width` values, that strided tree is the contiguous pairwise tree over the block's
 *     slices of `width` values taken in bit-reversed order, which a binary counter builds
 *     while streaming the slices; then the halving goes on in place down to `tail`.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 65536
/* Values a trimmed mean sorts at a time (its wires: n_combine rows of them). */
#define SORT_WIDTH 256
/* Slices decoded and aggregated before each row's trees take them (the bits do not depend
 * on it: each row's tree takes its slices in the same order). */
#define TREE_RUN 8

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif

static int64_t bit_reverse(int64_t value, int bits) {
    int64_t result = 0;
    for (int b = 0; b < bits; b++) {
        result = (result << 1) | ((value >> b) & 1);
    }
    return result;
}

enum { GIVEN = 0, WEIGHTED = 1, TRIMMED = 2 };

/* Rows 0..n-1's values at `offset` copied onto the wires (-0.0 made +0.0) and sorted per
 * coordinate by the comparators `pairs`. */
static inline void sort_slice(const float *const *rows, int64_t n, const int64_t *pairs,
                              int64_t n_pairs, float *wires, int64_t tail, int64_t offset,
                              int64_t valid) {
    for (int64_t i = 0; i < n; i++) {
        const float *row = rows[i] + offset;
        float *wire = wires + i * tail;
        for (int64_t j = 0; j < valid; j++) wire[j] = row[j] + 0.0f; /* -0.0 becomes +0.0 */
    }
    for (int64_t p = 0; p < n_pairs; p++) {
        float *a = wires + pairs[2 * p] * tail;
        float *b = wires + pairs[2 * p + 1] * tail;
        for (int64_t j = 0; j < valid; j++) {
            /* both stores unconditional: compilers make them min and max instructions,
             * not a branch on whether the pair is already in order (wires hold no -0.0) */
            const float x = a[j], y = b[j];
            const float low = y < x ? y : x, high = x < y ? y : x;
            a[j] = low;
            b[j] = high;
        }
    }
}

/* Eight coordinates of n <= 16 wires at a time, held in registers through the whole
 * network: Batcher's odd-even merge sort of 16 wires (rules_basic.sorting_network(16, 0, 15)),
 * the wires past n carrying +inf (they never move). A full sort decides every rank, so the
 * ranks a pass reads hold the same values, bit for bit, as the comparators it was given
 * leave there; each comparator is the same pair of selections as sort_slice's. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8f pick(v8i mask, v8f yes, v8f no) {
    return (v8f)(((v8i)yes & mask) | ((v8i)no & ~mask));
}

#define CX(a, b)                                                                              \
    do {                                                                                      \
        const v8f x_ = a, y_ = b;                                                             \
        a = pick(y_ < x_, y_, x_);                                                            \
        b = pick(x_ < y_, y_, x_);                                                            \
    } while (0)
#define LOAD(k)                                                                               \
    v8f w##k = infinite;                                                                      \
    if (k < n) {                                                                              \
        memcpy(&w##k, rows[k] + offset + j, sizeof(v8f));                                     \
        w##k = w##k + 0.0f; /* -0.0 becomes +0.0 */                                           \
    }
#define STORE(k)                                                                              \
    if (k < n) memcpy(wires + k * tail + j, &w##k, sizeof(v8f))

static inline __attribute__((always_inline)) void sort16_slice(const float *const *rows, int64_t n,
                                                              float *wires, int64_t tail,
                                int64_t offset, int64_t valid) {
    const float inf = __builtin_inff();
    const v8f infinite = {inf, inf, inf, inf, inf, inf, inf, inf};
    for (int64_t j = 0; j + 8 <= valid; j += 8) {
        LOAD(0) LOAD(1) LOAD(2) LOAD(3) LOAD(4) LOAD(5) LOAD(6) LOAD(7)
        LOAD(8) LOAD(9) LOAD(10) LOAD(11) LOAD(12) LOAD(13) LOAD(14) LOAD(15)
    CX(w0, w1);
    CX(w2, w3);
    CX(w4, w5);
    CX(w6, w7);
    CX(w8, w9);
    CX(w10, w11);
    CX(w12, w13);
    CX(w14, w15);
    CX(w0, w2);
    CX(w1, w3);
    CX(w4, w6);
    CX(w5, w7);
    CX(w8, w10);
    CX(w9, w11);
    CX(w12, w14);
    CX(w13, w15);
    CX(w1, w2);
    CX(w5, w6);
    CX(w9, w10);
    CX(w13, w14);
    CX(w0, w4);
    CX(w1, w5);
    CX(w2, w6);
    CX(w3, w7);
    CX(w8, w12);
    CX(w9, w13);
    CX(w10, w14);
    CX(w11, w15);
    CX(w2, w4);
    CX(w3, w5);
    CX(w10, w12);
    CX(w11, w13);
    CX(w1, w2);
    CX(w3, w4);
    CX(w5, w6);
    CX(w9, w10);
    CX(w11, w12);
    CX(w13, w14);
    CX(w0, w8);
    CX(w1, w9);
    CX(w2, w10);
    CX(w3, w11);
    CX(w4, w12);
    CX(w5, w13);
    CX(w6, w14);
    CX(w7, w15);
    CX(w4, w8);
    CX(w5, w9);
    CX(w6, w10);
    CX(w7, w11);
    CX(w2, w4);
    CX(w3, w5);
    CX(w6, w8);
    CX(w7, w9);
    CX(w10, w12);
    CX(w11, w13);
    CX(w1, w2);
    CX(w3, w4);
    CX(w5, w6);
    CX(w7, w8);
    CX(w9, w10);
    CX(w11, w12);
    CX(w13, w14);
        STORE(0); STORE(1); STORE(2); STORE(3); STORE(4); STORE(5); STORE(6); STORE(7);
        STORE(8); STORE(9); STORE(10); STORE(11); STORE(12); STORE(13); STORE(14); STORE(15);
    }
}

#undef CX
#undef LOAD
#undef STORE

/* The mean of the sorted wires' ranks trim..n-1-trim (added in rank order, one division)
 * into agg. */
static inline void mean_of_ranks(const float *wires, int64_t n, int64_t trim, int64_t tail,
                                 int64_t valid, float *agg) {
    const int64_t kept = n - 2 * trim;
    const float *first = wires + trim * tail;
    if (kept == 1) {
        for (int64_t j = 0; j < valid; j++) agg[j] = first[j];
        return;
    }
    const float *second = first + tail;
    for (int64_t j = 0; j < valid; j++) agg[j] = first[j] + second[j];
    for (int64_t rank = trim + 2; rank < n - trim; rank++) {
        const float *wire = wires + rank * tail;
        for (int64_t j = 0; j < valid; j++) agg[j] = agg[j] + wire[j];
    }
    const float divisor = (float)kept;
    for (int64_t j = 0; j < valid; j++) agg[j] = agg[j] / divisor;
}

/* Per row, the coordinates outside the kept ranks trim..n-1-trim of the sorted wires,
 * added to dropped[row]. */
static inline void count_dropped(const float *const *rows, int64_t n, const float *wires,
                                 int64_t trim, int64_t tail, int64_t offset, int64_t valid,
                                 int64_t *dropped) {
    if (trim == 0) return;
    const float *low = wires + trim * tail;
    const float *high = wires + (n - 1 - trim) * tail;
    for (int64_t i = 0; i < n; i++) {
        const float *row = rows[i] + offset;
        int32_t count = 0; /* at most SORT_WIDTH */
        for (int64_t j = 0; j < valid; j++) count += (row[j] < low[j]) + (row[j] > high[j]);
        dropped[i] += count;
    }
}

/* p2p_dequantise_int8's decode (see there). */
static inline int dequantise(const int8_t *q, const float *scale, int64_t n, int64_t block_size,
                             int64_t lead, float *out) {
    if (n <= 0) return 0;
    const int64_t blocks = (lead + n - 1) / block_size + 1;
    for (int64_t b = 0; b < blocks; b++) {
        const float s = scale[b];
        if (!(s >= 0.0f) || s > 3.4028234663852886e38f) return 2;
    }
    int bad = 0, overflow = 0;
    int64_t j = 0;
    for (int64_t b = 0; b < blocks; b++) {
        int64_t end = (b + 1) * block_size - lead;
        if (end > n) end = n;
        const float s = scale[b];
        /* min and max reductions (vectorised), not a test per value: a block's largest
         * value in magnitude is its largest code in magnitude times its scale */
        int lowest = 0, highest = 0;
        for (int64_t k = j; k < end; k++) {
            const int v = q[k];
            lowest = v < lowest ? v : lowest;
            highest = v > highest ? v : highest;
            out[k] = (float)v * s;
        }
        bad |= lowest == -128;
        const float largest = (float)(highest > -lowest ? highest : -lowest) * s;
        overflow |= !(largest <= 3.4028234663852886e38f);
        j = end;
    }
    return bad ? 1 : overflow ? 3 : 0;
}

/* Update rows held as int8 codes (codec_dense's int8: each parameter's codes, and one
 * scale per block_size codes), decoded a slice at a time inside a pass: rows 0..rows-1 of
 * the pass. The parameters are `segments` non-empty runs of positions: parameter k holds
 * positions starts[k]..starts[k+1]-1 (starts[0] = 0, starts[segments] = the length); row i's
 * codes and scales of parameter k are at the addresses q[i * segments + k] and
 * scale[i * segments + k]. */
typedef struct {
    int64_t rows;
    int64_t segments;
    const int64_t *starts;
    int64_t block_size;
    const int64_t *q;
    const int64_t *scale;
} p2p_codes;

/* Row i's values at positions offset..offset+valid-1, decoded into out; the worst decode
 * status (see p2p_dequantise_int8) is kept in *status. */
static inline void decode_slice(const p2p_codes *codes, int64_t i, int64_t offset, int64_t valid,
                         float *out, int32_t *status) {
    int64_t low = 0, high = codes->segments - 1; /* the last parameter starting <= offset */
    while (low < high) {
        const int64_t mid = (low + high + 1) / 2;
        if (codes->starts[mid] <= offset) low = mid;
        else high = mid - 1;
    }
    const int64_t end = offset + valid;
    int64_t x = offset;
    for (int64_t k = low; x < end && k < codes->segments; k++) {
        const int64_t stop = codes->starts[k + 1] < end ? codes->starts[k + 1] : end;
        const int64_t j = x - codes->starts[k];
        const int8_t *q = (const int8_t *)(intptr_t)codes->q[i * codes->segments + k];
        const float *scale = (const float *)(intptr_t)codes->scale[i * codes->segments + k];
        const int found = dequantise(q + j, scale + j / codes->block_size, stop - x,
                                     codes->block_size, j % codes->block_size, out + (x - offset));
        if (found > *status) *status = found;
        x = stop;
    }
}

/* One slice's terms: (row - agg)^2 (the difference rounded to float32, squared exactly in
 * float64) or with `products` row * agg (exact in float64); zeros past `valid`. */
static inline void slice_terms(const float *row, const float *agg, int64_t valid, int64_t tail,
                               int64_t products, double *out) {
    if (products) {
        for (int64_t j = 0; j < valid; j++) out[j] = (double)row[j] * (double)agg[j];
    } else {
        for (int64_t j = 0; j < valid; j++) {
            const double d = (double)(row[j] - agg[j]);
            out[j] = d * d;
        }
    }
    for (int64_t j = valid; j < tail; j++) out[j] = 0.0;
}

/* left + the slice's terms, into out (the first merge of the binary counter, fused). */
static inline void slice_terms_onto(const float *row, const float *agg, int64_t valid,
                                    int64_t tail, int64_t products, const double *left,
                                    double *out) {
    if (products) {
        for (int64_t j = 0; j < valid; j++) out[j] = left[j] + (double)row[j] * (double)agg[j];
    } else {
        for (int64_t j = 0; j < valid; j++) {
            const double d = (double)(row[j] - agg[j]);
            out[j] = left[j] + d * d;
        }
    }
    for (int64_t j = valid; j < tail; j++) out[j] = left[j] + 0.0;
}

/* The binary counter's work for TREE_RUN (8) consecutive full slices of one row, the run
 * `index`-th of its block: their subtree ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)),
 * per value, is what the counter builds on level 3 from them one slice at a time (each
 * merge is left + right), so it is summed in registers and merged into the levels from 3 up
 * as the counter merges a subtree landing there: the same additions in the same order. */
static inline void run_tree(const float *const *row, const float *const *other, int64_t width,
                            int64_t products, int64_t index, double *levels_of_row) {
    int top = 0;
    while ((index >> top) & 1) top++;
    double *restrict out = levels_of_row + (3 + top) * width;
    const float *restrict r0 = row[0], *restrict r1 = row[1], *restrict r2 = row[2];
    const float *restrict r3 = row[3], *restrict r4 = row[4], *restrict r5 = row[5];
    const float *restrict r6 = row[6], *restrict r7 = row[7];
    const float *restrict o0 = other[0], *restrict o1 = other[1], *restrict o2 = other[2];
    const float *restrict o3 = other[3], *restrict o4 = other[4], *restrict o5 = other[5];
    const float *restrict o6 = other[6], *restrict o7 = other[7];
    if (products) {
        for (int64_t j = 0; j < width; j++) {
            const double t0 = (double)r0[j] * (double)o0[j], t1 = (double)r1[j] * (double)o1[j];
            const double t2 = (double)r2[j] * (double)o2[j], t3 = (double)r3[j] * (double)o3[j];
            const double t4 = (double)r4[j] * (double)o4[j], t5 = (double)r5[j] * (double)o5[j];
            const double t6 = (double)r6[j] * (double)o6[j], t7 = (double)r7[j] * (double)o7[j];
            out[j] = ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7));
        }
    } else {
        for (int64_t j = 0; j < width; j++) {
            const double d0 = (double)(r0[j] - o0[j]), d1 = (double)(r1[j] - o1[j]);
            const double d2 = (double)(r2[j] - o2[j]), d3 = (double)(r3[j] - o3[j]);
            const double d4 = (double)(r4[j] - o4[j]), d5 = (double)(r5[j] - o5[j]);
            const double d6 = (double)(r6[j] - o6[j]), d7 = (double)(r7[j] - o7[j]);
            out[j] = ((d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3)) +
                     ((d4 * d4 + d5 * d5) + (d6 * d6 + d7 * d7));
        }
    }
    /* merged as the counter merges: the pending subtree on each level below, + this one */
    for (int level = 3; level < 3 + top; level++) {
        const double *restrict left = levels_of_row + level * width;
        for (int64_t j = 0; j < width; j++) out[j] = left[j] + out[j];
    }
}

/* Returns 0, or -1 when scratch memory could not be allocated (nothing written).
 * `rows[i]` and `aggregate` point at the values of position `base` (a span of the vectors);
 * `length` and the blocks count positions of the whole vectors. A NULL `partial` asks for
 * the aggregate alone (no distances); `products` sums each row's products with the
 * aggregate (exact in float64) instead of its squared distances; a non-NULL `squares`
 * (shaped like `partial`) gets, in the same pass, each row's sums of its own squares.
 * mode GIVEN: `aggregate` is read; WEIGHTED: sum_k coefficients[k] * rows[combine[k]];
 * TRIMMED: rows 0..n_combine-1 sorted per coordinate by the comparators `pairs`, `trim`
 * dropped from each side, the drops counted into dropped[0..n_combine-1].
 * A non-NULL `second` (TRIMMED only; like `aggregate`, a span at `base`) gets, from the same
 * sort, the mean of ranks second_trim..n_combine-1-second_trim (the comparators must decide
 * those ranks too); the drops are then counted for second_trim, and `second_partial`
 * (shaped like `partial`) gets each row's squared distances to `second`.
 * A non-NULL `codes` decodes rows 0..codes->rows-1 from int8 codes (their `rows` entries are
 * not read), each row's worst decode status kept in code_status[row]: any status but 0
 * makes the pass's results meaningless. */
MULTIVERSION
int p2p_stream_pass(const float *const *rows, int64_t n_rows, int64_t mode,
                    const int64_t *combine_index, const float *coefficients, int64_t n_combine,
                    const int64_t *pairs, int64_t n_pairs, int64_t trim, int64_t *dropped,
                    float *aggregate, int64_t length, int64_t base, int64_t block_begin,
                    int64_t block_end, int64_t width, int64_t tail, double *partial,
                    int64_t partial_blocks, int64_t products, double *squares,
                    int64_t second_trim, float *second, double *second_partial,
                    const p2p_codes *codes, int32_t *code_status) {
    const int64_t slices = CHUNK / width;
    int bits = 0;
    while (((int64_t)1 << bits) < slices) bits++;
    const int levels = bits + 1;
    if (mode != TRIMMED) second = NULL;
    if (second == NULL) second_partial = NULL;
    /* the trees, each a sum per row: terms against `aggregate` (squared distances or
     * products), the row's own squares, squared distances to `second` */
    double *kept_by[3];
    const float *other_of[3];
    int64_t products_of[3];
    int trees = 0;
    if (partial != NULL) {
        kept_by[trees] = partial, other_of[trees] = aggregate, products_of[trees++] = products;
        if (squares != NULL) {
            kept_by[trees] = squares, other_of[trees] = NULL, products_of[trees++] = 1;
        }
        if (second_partial != NULL) {
            kept_by[trees] = second_partial, other_of[trees] = second, products_of[trees++] = 0;
        }
    }
    /* per tree and row: `levels` pending partial sums of `width` values */
    double *stack = malloc(sizeof(double) * (size_t)((trees ? trees : 1) * n_rows * levels) *
                           (size_t)width);
    float *zeros = calloc((size_t)width, sizeof(float));
    if (stack == NULL || zeros == NULL) {
        free(stack);
        free(zeros);
        return -1;
    }
    /* each row's values of the slices of a run: in place, or decoded into `decoded` */
    const int64_t run = slices < TREE_RUN ? slices : TREE_RUN;
    const int64_t code_rows = codes == NULL ? 0 : codes->rows;
    const float **at = malloc(sizeof(float *) * (size_t)(n_rows * run));
    float *decoded =
        malloc(sizeof(float) * (size_t)((code_rows ? code_rows : 1) * width * run));
    float *wires = malloc(sizeof(float) * (size_t)((mode == TRIMMED ? n_combine : 1) * SORT_WIDTH));
    int64_t offsets[TREE_RUN], valids[TREE_RUN];
    if (at == NULL || decoded == NULL || wires == NULL) {
        free(stack);
        free(zeros);
        free(at);
        free(decoded);
        free(wires);
        return -1;
    }

    for (int64_t block = block_begin; block < block_end; block++) {
        const int64_t block_start = block * CHUNK;
        for (int64_t first = 0; first < slices; first += run) {
            /* the aggregate of `run` slices, then each row's trees over them (its levels stay
             * in cache while it takes the run's slices, in the same order as one by one) */
            for (int64_t s = 0; s < run; s++) {
                const int64_t r = first + s;
                const int64_t offset = block_start + bit_reverse(r, bits) * width;
                int64_t valid = length - offset;
                if (valid > width) valid = width;
                if (valid < 0) valid = 0;
                offsets[s] = offset, valids[s] = valid;
                float *agg = aggregate + (offset - base);
                const float **at_s = at + s * n_rows;
                for (int64_t i = 0; i < n_rows; i++) {
                    if (i < code_rows) {
                        float *values = decoded + (s * code_rows + i) * width;
                        if (valid > 0) decode_slice(codes, i, offset, valid, values, code_status + i);
                        at_s[i] = values;
                    } else {
                        at_s[i] = rows[i] == NULL ? zeros : rows[i] + (offset - base);
                    }
                }
                if (mode == TRIMMED && valid > 0) {
                    /* sorted in narrower pieces, so the wires stay in L1 */
                    for (int64_t piece = 0; piece < valid; piece += SORT_WIDTH) {
                        const int64_t count =
                            valid - piece < SORT_WIDTH ? valid - piece : SORT_WIDTH;
                        if (n_combine > 8 && n_combine <= 16 && count % 8 == 0) {
                            sort16_slice(at_s, n_combine, wires, SORT_WIDTH, piece, count);
                        } else {
                            sort_slice(at_s, n_combine, pairs, n_pairs, wires, SORT_WIDTH, piece,
                                       count);
                        }
                        mean_of_ranks(wires, n_combine, trim, SORT_WIDTH, count, agg + piece);
                        if (second != NULL) {
                            mean_of_ranks(wires, n_combine, second_trim, SORT_WIDTH, count,
                                          second + (offset - base) + piece);
                        }
                        count_dropped(at_s, n_combine, wires, second == NULL ? trim : second_trim,
                                      SORT_WIDTH, piece, count, dropped);
                    }
                } else if (mode == WEIGHTED && valid > 0) {
                    const float *head = at_s[combine_index[0]];
                    const float c0 = coefficients[0];
                    for (int64_t j = 0; j < valid; j++) agg[j] = head[j] * c0;
                    for (int64_t k = 1; k < n_combine; k++) {
                        const float *row = at_s[combine_index[k]];
                        const float c = coefficients[k];
                        for (int64_t j = 0; j < valid; j++) {
                            const float product = row[j] * c;
                            agg[j] = agg[j] + product;
                        }
                    }
                }
            }
            if (partial == NULL) continue; /* the aggregate alone */
            int full = run == TREE_RUN;
            for (int64_t s = 0; s < run; s++) full = full && valids[s] == width;
            for (int64_t i = 0; i < n_rows; i++) {
                for (int t = 0; t < trees; t++) {
                    const int64_t as_products = products_of[t];
                    double *levels_of_row = stack + (t * n_rows + i) * levels * width;
                    if (full) {
                        const float *row_of[TREE_RUN], *other_in[TREE_RUN];
                        for (int64_t s = 0; s < TREE_RUN; s++) {
                            row_of[s] = at[s * n_rows + i];
                            other_in[s] = other_of[t] == NULL
                                              ? row_of[s]
                                              : other_of[t] + (offsets[s] - base);
                        }
                        run_tree(row_of, other_in, width, as_products, first / TREE_RUN,
                                 levels_of_row);
                        continue;
                    }
                    for (int64_t s = 0; s < run; s++) {
                        const int64_t r = first + s;
                        const float *row = at[s * n_rows + i];
                        /* a square is the row's product with itself */
                        const float *other =
                            other_of[t] == NULL ? row : other_of[t] + (offsets[s] - base);
                        /* binary counter: this slice's subtree lands on level `top` (free:
                         * the levels below it hold the pending subtrees, each merged in as
                         * left + right) */
                        int top = 0;
                        while ((r >> top) & 1) top++;
                        double *out = levels_of_row + top * width;
                        if (top == 0) {
                            slice_terms(row, other, valids[s], width, as_products, out);
                            continue;
                        }
                        slice_terms_onto(row, other, valids[s], width, as_products,
                                         levels_of_row, out);
                        for (int level = 1; level < top; level++) {
                            const double *left = levels_of_row + level * width;
                            for (int64_t j = 0; j < width; j++) out[j] = left[j] + out[j];
                        }
                    }
                }
            }
        }
        for (int64_t k = 0; partial != NULL && k < trees * n_rows; k++) {
            double *sum = stack + (k * levels + bits) * width;
            /* the block's tree goes on halving down to the `tail` values kept */
            for (int64_t h = width / 2; h >= tail; h /= 2) {
                for (int64_t j = 0; j < h; j++) sum[j] = sum[j] + sum[j + h];
            }
            double *kept = kept_by[k / n_rows];
            memcpy(kept + ((k % n_rows) * partial_blocks + block) * tail, sum,
                   sizeof(double) * (size_t)tail);
        }
    }
    free(stack);
    free(zeros);
    free(at);
    free(decoded);
    free(wires);
    return 0;
}

/* Decode `n` int8 codes: out[j] = (float)q[j] * scale[(lead + j) / block_size], one float32
 * rounding each (codec_dense's int8 decode), where `lead` is q[0]'s position in its block.
 * Returns 0 (every value written is finite); 1 when a code is -128 (nothing meaningful
 * written); 2 when a scale it uses is negative, infinite or NaN (nothing written); 3 when a
 * code times its scale overflows to infinity. */
MULTIVERSION
int p2p_dequantise_int8(const int8_t *q, const float *scale, int64_t n, int64_t block_size,
                        int64_t lead, float *out) {
    return dequantise(q, scale, n, block_size, lead, out);
}

/* Nesterov momentum (aggregate/outer.py's OuterNesterov, the same float32 operations in the
 * same order, each one rounding): buf = mu * old + g (old NULL: zeros, buf = 0 + g);
 * step = lr * (g + mu * buf); new_theta = theta - step; new_buf = buf. */
MULTIVERSION
void p2p_nesterov(const float *theta, const float *g, const float *old, int64_t n, float mu,
                  float lr, float *new_theta, float *new_buf) {
    for (int64_t j = 0; j < n; j++) {
        const float kept = old == NULL ? 0.0f : old[j] * mu;
        const float buf = kept + g[j];
        const float ahead = buf * mu;
        const float step = (g[j] + ahead) * lr;
        new_theta[j] = theta[j] - step;
        new_buf[j] = buf;
    }
}

/* The SHA-256 of this file's bytes, set by the build that compiled it into the package
 * (setup.py): a loader refuses a library built from another version of the source. */
#ifndef P2P_SOURCE_HASH
#define P2P_SOURCE_HASH ""
#endif
const char *p2p_source_hash(void) { return P2P_SOURCE_HASH; }
