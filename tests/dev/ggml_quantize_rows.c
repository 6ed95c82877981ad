// Quantizes raw little-endian f32 rows with ggml's own ggml_quantize_chunk and writes the blocks
// to stdout: the oracle for quantizer paths llama-quantize never takes (low-bit types without
// an importance matrix) and for synthetic rows with many exact ties. See gen_ggml_rows_golden.sh.
// usage: ggml_quantize_rows TYPE_ID IN.f32 N_PER_ROW [IMATRIX.f32] > OUT
#include "ggml.h"
#include <stdio.h>
#include <stdlib.h>

static float * read_f32(const char * path, long * n) {
    FILE * f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END);
    long bytes = ftell(f);
    fseek(f, 0, SEEK_SET);
    float * v = malloc(bytes);
    if (!v || fread(v, 1, bytes, f) != (size_t) bytes) { fprintf(stderr, "read %s\n", path); exit(2); }
    fclose(f);
    *n = bytes / 4;
    return v;
}

int main(int argc, char ** argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s TYPE_ID IN.f32 N_PER_ROW [IMATRIX.f32]\n", argv[0]); return 2; }
    enum ggml_type type = (enum ggml_type) atoi(argv[1]);
    long n, n_per_row = atol(argv[3]), nw = 0;
    float * x = read_f32(argv[2], &n);
    float * w = argc > 4 ? read_f32(argv[4], &nw) : NULL;
    if (w && nw != n_per_row) { fprintf(stderr, "imatrix has %ld values\n", nw); return 2; }
    long nrows = n / n_per_row;
    size_t row = ggml_row_size(type, n_per_row);
    void * out = malloc(row * nrows);
    size_t got = ggml_quantize_chunk(type, x, out, 0, nrows, n_per_row, w);
    fwrite(out, 1, got, stdout);
    return 0;
}
