/* Which x86 instruction-set extensions that `-march=native` turns on actually
 * run on this machine. scripts/bench_setup.sh compiles this with the same
 * compiler and `-march=native` that a native llama.cpp build uses, runs it, and
 * builds llama.cpp natively with `-mno-<ext>` for each extension reported as
 * "faults" (for example AMX on a virtual machine whose CPUID lists AMX but
 * whose kernel or hypervisor does not enable the tile state: SIGILL).
 *
 * Output: one line per extension that the compiler enables, `<ext> ok` or
 * `<ext> faults (<signal>)`, where <ext> is the gcc/clang option suffix
 * (`-m<ext>` / `-mno-<ext>`). Each probe runs one instruction of its
 * extension in a forked child, so a fault kills only the child. AMX is probed
 * as ggml uses it (ggml-cpu/amx/amx.cpp): request the tile-data permission
 * with arch_prctl(ARCH_REQ_XCOMP_PERM), then configure and use the tiles; a
 * refused permission counts as a fault.
 *
 * Exit status: 0 (also when some extension faults), 2 if fork fails.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile int sink_i;
static volatile float sink_f;
static volatile float in_f[32] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                  1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static volatile int in_i[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

#define LOAD_PS256() _mm256_loadu_ps((const float *)in_f)
#define LOAD_SI256() _mm256_loadu_si256((const __m256i *)in_i)
#define LOAD_PS512() _mm512_loadu_ps((const float *)in_f)
#define LOAD_SI512() _mm512_loadu_si512((const void *)in_i)

#ifdef __AVX__
static void probe_avx(void) { sink_f = _mm256_cvtss_f32(_mm256_add_ps(LOAD_PS256(), LOAD_PS256())); }
#endif
#ifdef __AVX2__
static void probe_avx2(void) { sink_i = _mm256_extract_epi32(_mm256_add_epi32(LOAD_SI256(), LOAD_SI256()), 1); }
#endif
#ifdef __FMA__
static void probe_fma(void) {
    sink_f = _mm256_cvtss_f32(_mm256_fmadd_ps(LOAD_PS256(), LOAD_PS256(), LOAD_PS256()));
}
#endif
#ifdef __F16C__
static void probe_f16c(void) {
    sink_f = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(_mm_loadu_ps((const float *)in_f), 0)));
}
#endif
#ifdef __BMI2__
static void probe_bmi2(void) { sink_i = (int)_pdep_u32((unsigned)in_i[3], 0x0f0f0f0fu); }
#endif
#ifdef __AVX512F__
static void probe_avx512f(void) { sink_f = _mm512_reduce_add_ps(_mm512_add_ps(LOAD_PS512(), LOAD_PS512())); }
#endif
#ifdef __AVX512BW__
static void probe_avx512bw(void) {
    sink_i = _mm512_reduce_add_epi32(_mm512_add_epi8(LOAD_SI512(), LOAD_SI512()));
}
#endif
#ifdef __AVX512VL__
static void probe_avx512vl(void) {
    sink_f = _mm256_cvtss_f32(_mm256_maskz_add_ps(0x0f, LOAD_PS256(), LOAD_PS256()));
}
#endif
#ifdef __AVX512DQ__
static void probe_avx512dq(void) {
    sink_f = _mm512_reduce_add_ps(_mm512_and_ps(LOAD_PS512(), LOAD_PS512()));
}
#endif
#ifdef __AVX512CD__
static void probe_avx512cd(void) { sink_i = _mm512_reduce_add_epi32(_mm512_conflict_epi32(LOAD_SI512())); }
#endif
#ifdef __AVX512VBMI__
static void probe_avx512vbmi(void) {
    sink_i = _mm512_reduce_add_epi32(_mm512_permutexvar_epi8(LOAD_SI512(), LOAD_SI512()));
}
#endif
#ifdef __AVX512VNNI__
static void probe_avx512vnni(void) {
    sink_i = _mm512_reduce_add_epi32(_mm512_dpbusd_epi32(LOAD_SI512(), LOAD_SI512(), LOAD_SI512()));
}
#endif
#ifdef __AVX512BF16__
static void probe_avx512bf16(void) {
    __m512bh b = _mm512_cvtne2ps_pbh(LOAD_PS512(), LOAD_PS512());
    sink_f = _mm512_reduce_add_ps(_mm512_dpbf16_ps(LOAD_PS512(), b, b));
}
#endif
#ifdef __AVXVNNI__
static void probe_avxvnni(void) {
    sink_i = _mm256_extract_epi32(_mm256_dpbusd_avx_epi32(LOAD_SI256(), LOAD_SI256(), LOAD_SI256()), 0);
}
#endif
#ifdef __AMX_TILE__
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static int amx_permission(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* Asks for the tile state (exit 3 if refused), then configures palette 1
 * with tiles 0-2 of 16 rows x 64 bytes and zeroes them. */
static void amx_setup(void) {
    if (!amx_permission()) _exit(3);
    unsigned char cfg[64];
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;
    for (int t = 0; t < 3; t++) {
        cfg[16 + 2 * t] = 64; /* colsb[t], bytes per row (little-endian u16) */
        cfg[48 + t] = 16;     /* rows[t] */
    }
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
}
static void probe_amx_tile(void) {
    amx_setup();
    _tile_release();
}
#endif
#ifdef __AMX_INT8__
static void probe_amx_int8(void) {
    amx_setup();
    _tile_dpbssd(0, 1, 2);
    _tile_release();
}
#endif
#ifdef __AMX_BF16__
static void probe_amx_bf16(void) {
    amx_setup();
    _tile_dpbf16ps(0, 1, 2);
    _tile_release();
}
#endif

/* Runs f in a child; prints `<name> ok` or `<name> faults (...)`. */
static int probe(const char *name, void (*f)(void)) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        perror("cpu_probe: fork");
        return -1;
    }
    if (pid == 0) {
        f();
        _exit(0);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) < 0) {
        perror("cpu_probe: waitpid");
        return -1;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
        printf("%s ok\n", name);
    else if (WIFEXITED(status) && WEXITSTATUS(status) == 3)
        printf("%s faults (arch_prctl(ARCH_REQ_XCOMP_PERM) refused the AMX tile state)\n", name);
    else if (WIFSIGNALED(status))
        printf("%s faults (%s)\n", name, strsignal(WTERMSIG(status)));
    else
        printf("%s faults (exit %d)\n", name, WEXITSTATUS(status));
    return 0;
}

#define PROBE(name, fn) \
    if (probe(name, fn) < 0) return 2

int main(void) {
#ifdef __AVX__
    PROBE("avx", probe_avx);
#endif
#ifdef __AVX2__
    PROBE("avx2", probe_avx2);
#endif
#ifdef __FMA__
    PROBE("fma", probe_fma);
#endif
#ifdef __F16C__
    PROBE("f16c", probe_f16c);
#endif
#ifdef __BMI2__
    PROBE("bmi2", probe_bmi2);
#endif
#ifdef __AVX512F__
    PROBE("avx512f", probe_avx512f);
#endif
#ifdef __AVX512BW__
    PROBE("avx512bw", probe_avx512bw);
#endif
#ifdef __AVX512VL__
    PROBE("avx512vl", probe_avx512vl);
#endif
#ifdef __AVX512DQ__
    PROBE("avx512dq", probe_avx512dq);
#endif
#ifdef __AVX512CD__
    PROBE("avx512cd", probe_avx512cd);
#endif
#ifdef __AVX512VBMI__
    PROBE("avx512vbmi", probe_avx512vbmi);
#endif
#ifdef __AVX512VNNI__
    PROBE("avx512vnni", probe_avx512vnni);
#endif
#ifdef __AVX512BF16__
    PROBE("avx512bf16", probe_avx512bf16);
#endif
#ifdef __AVXVNNI__
    PROBE("avxvnni", probe_avxvnni);
#endif
#ifdef __AMX_TILE__
    PROBE("amx-tile", probe_amx_tile);
#endif
#ifdef __AMX_INT8__
    PROBE("amx-int8", probe_amx_int8);
#endif
#ifdef __AMX_BF16__
    PROBE("amx-bf16", probe_amx_bf16);
#endif
    return 0;
}
