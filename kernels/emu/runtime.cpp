// The emulator's scheduler, linked into every emulated module (kernels/emu/src/lib.rs compiles
// it once, with cuda_emu.h force-included, and caches the object).
//
// A launch runs the grid's blocks one after another, x fastest. The threads of a block are
// fibers (ucontext) on the launching OS thread; a fiber runs until it reaches a barrier or warp
// collective (or exits), then the next runnable fiber in thread order runs. No other switch
// happens, so a launch is deterministic and needs no locking inside.
//
// Warp collectives: an arriving lane records (op, mask, value, argument) and waits; the lane
// that completes the set of the mask (or the exit of the last lane it waited for) computes
// every lane's result into that lane's own slot (a lane that resumes first cannot disturb
// inputs the others still need). Misuse that is undefined on the GPU is reported instead of
// emulated: lanes of a mask meeting different collectives, a mask not naming the caller, a
// shuffle reading a lane outside its mask or one that has exited, different barrier kinds
// meeting, and deadlock (no thread can proceed). The report ends the launch: emu_launch
// returns -1 and emu_last_error() says which kernel, block and thread, and what.

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

// Linker-defined bounds of the section that holds every __shared__ variable of the module
// (emu.ld gathers them there).
extern "C" char __start_emu_shared[] __attribute__((visibility("hidden")));
extern "C" char __stop_emu_shared[] __attribute__((visibility("hidden")));
// Keeps the section (and so its bounds) present in modules that declare no shared variable.
static char emu_shared_anchor __attribute__((section("emu_shared"), used));

namespace {

enum State : unsigned char { READY, AT_WARP, AT_BARRIER, EXITED };

struct Fiber {
    ucontext_t ctx;
    State state;
    unsigned lin;  // linear thread index: x + y * bx + z * bx * by (CUDA's warp numbering)
    uint3 tid;
    int op, arg, width, size;
    unsigned mask;
    unsigned long long value, result;
    void* out;  // EMU_ALLGATHER: where this lane receives every lane's bytes
    int bar_kind, pred;
};

struct Launch {
    const char* entry = "";
    unsigned n = 0;  // threads per block
    unsigned cur = 0;
    unsigned live = 0;        // threads of the block not exited
    unsigned at_barrier = 0;  // threads waiting in a barrier
    int bar_kind = 0;
    std::vector<Fiber> fibers;
    ucontext_t sched;
    void (*body)(void*) = nullptr;
    void* ctx = nullptr;
    bool failed = false;
    bool running = false;
};

Launch L;
std::string g_error;

const size_t STACK_BYTES = 256 * 1024;
size_t g_page = 4096;
std::vector<char*> g_stacks;  // usable bottom of each fiber stack (guard page below it)

// Dynamic shared memory: a mapping whose last page is a guard, the buffer ending right below
// it, so an access past the launch's dynamic size faults instead of reading a neighbour.
char* g_dyn_map = nullptr;
size_t g_dyn_map_len = 0;
char* g_dyn = nullptr;
size_t g_dyn_len = 0;

const char* op_name(int op) {
    switch (op) {
        case EMU_SHFL_IDX: return "__shfl_sync";
        case EMU_SHFL_UP: return "__shfl_up_sync";
        case EMU_SHFL_DOWN: return "__shfl_down_sync";
        case EMU_SHFL_XOR: return "__shfl_xor_sync";
        case EMU_BALLOT: return "__ballot_sync";
        case EMU_ANY: return "__any_sync";
        case EMU_ALL: return "__all_sync";
        case EMU_MATCH_ANY: return "__match_any_sync";
        case EMU_SYNCWARP: return "__syncwarp";
        case EMU_REDUCE_ADD: return "__reduce_add_sync";
        case EMU_REDUCE_MIN: return "__reduce_min_sync";
        case EMU_REDUCE_MAX: return "__reduce_max_sync";
        case EMU_REDUCE_AND: return "__reduce_and_sync";
        case EMU_REDUCE_OR: return "__reduce_or_sync";
        case EMU_REDUCE_XOR: return "__reduce_xor_sync";
        case EMU_ALLGATHER: return "warp all-gather (mma / ldmatrix emulation)";
    }
    return "warp collective";
}

const char* bar_name(int kind) {
    switch (kind) {
        case EMU_BAR_SYNC: return "__syncthreads";
        case EMU_BAR_OR: return "__syncthreads_or";
        case EMU_BAR_AND: return "__syncthreads_and";
        case EMU_BAR_COUNT: return "__syncthreads_count";
    }
    return "barrier";
}

std::string where(const Fiber& f) {
    char b[256];
    snprintf(b, sizeof b, "kernel `%s`, block (%u,%u,%u), thread (%u,%u,%u) (warp %u lane %u): ",
             L.entry, blockIdx.x, blockIdx.y, blockIdx.z, f.tid.x, f.tid.y, f.tid.z, f.lin / 32,
             f.lin % 32);
    return b;
}

std::string fmt(const char* f, va_list ap) {
    char b[1024];
    vsnprintf(b, sizeof b, f, ap);
    return b;
}

// Ends the launch from inside a fiber: back to emu_launch, which returns -1.
[[noreturn]] void fail(const char* f, ...) {
    va_list ap;
    va_start(ap, f);
    g_error = "emu: " + where(L.fibers[L.cur]) + fmt(f, ap);
    va_end(ap);
    L.failed = true;
    setcontext(&L.sched);
    abort();  // setcontext does not return
}

std::string state_of(const Fiber& f) {
    char b[128];
    switch (f.state) {
        case READY: return "running";
        case EXITED: return "exited";
        case AT_BARRIER: return bar_name(f.bar_kind);
        case AT_WARP:
            snprintf(b, sizeof b, "%s (mask 0x%08x)", op_name(f.op), f.mask);
            return b;
    }
    return "?";
}

// Threads grouped into runs of equal state, for the deadlock report.
std::string block_states() {
    std::string out;
    unsigned i = 0;
    while (i < L.n) {
        const std::string s = state_of(L.fibers[i]);
        unsigned j = i + 1;
        while (j < L.n && state_of(L.fibers[j]) == s) ++j;
        char b[64];
        if (j - i == 1) snprintf(b, sizeof b, "%sthread %u: ", out.empty() ? "" : "; ", i);
        else snprintf(b, sizeof b, "%sthreads %u-%u: ", out.empty() ? "" : "; ", i, j - 1);
        out += b;
        out += s;
        i = j;
    }
    return out;
}

void enter(unsigned i) {
    L.cur = i;
    threadIdx = L.fibers[i].tid;
}

// Runs the next runnable fiber after the current one (in thread order, wrapping); returns when
// the current fiber is resumed. With `save` false the current fiber is abandoned (it exited).
void switch_next(bool save) {
    const unsigned me = L.cur;
    for (unsigned k = 1; k <= L.n; ++k) {
        const unsigned i = (me + k) % L.n;
        if (L.fibers[i].state != READY) continue;
        if (i == me) return;
        enter(i);
        if (save) swapcontext(&L.fibers[me].ctx, &L.fibers[i].ctx);
        else setcontext(&L.fibers[i].ctx);
        return;
    }
    if (L.live == 0) setcontext(&L.sched);  // the block is done
    fail("deadlock: no thread of the block can proceed (%s)", block_states().c_str());
}

// The source lane of a shuffle for lane `i`, as PTX shfl.sync computes it from the segment
// mask (32 - width) and the clamp: out-of-segment sources read the lane's own value.
unsigned shfl_src(int op, unsigned i, int b, int width) {
    const unsigned seg = (unsigned)(32 - width) & 31u;
    const int min_lane = (int)(i & seg);
    const int max_lane = op == EMU_SHFL_UP ? min_lane : (int)((i & seg) | (31u & ~seg));
    int j = (int)i;
    bool ok = true;
    switch (op) {
        case EMU_SHFL_IDX:
            j = min_lane | (int)((unsigned)b & ~seg & 31u);
            ok = j <= max_lane;
            break;
        case EMU_SHFL_UP:
            j = (int)i - b;
            ok = j >= max_lane;
            break;
        case EMU_SHFL_DOWN:
            j = (int)i + b;
            ok = j <= max_lane;
            break;
        case EMU_SHFL_XOR:
            j = (int)(i ^ (unsigned)b);
            ok = j <= max_lane;
            break;
    }
    return ok ? (unsigned)j : i;
}

unsigned long long size_mask(int size) {
    return size >= 8 ? ~0ull : (1ull << (8 * size)) - 1;
}

// Completes the collective that lane `ref` of `warp` waits in once every lane of its mask
// waits in it too. Lanes of the mask that have exited (or do not exist: a partial last warp)
// take no part, as on sm_70+ ("all non-exited threads named in mask must execute the same
// intrinsic"); reading a shuffle value from one is undefined there and reported here.
void try_complete_warp(unsigned warp, const Fiber& ref) {
    const unsigned base = warp * 32, mask = ref.mask;
    const int op = ref.op;
    unsigned active = 0;
    for (unsigned l = 0; l < 32; ++l) {
        if (!((mask >> l) & 1u)) continue;
        if (base + l >= L.n || L.fibers[base + l].state == EXITED) {
            // mma.sync / ldmatrix are .aligned: the whole warp executes them.
            if (op == EMU_ALLGATHER)
                fail("%s with mask 0x%08x: lane %u %s", op_name(op), mask, l,
                     base + l >= L.n ? "does not exist" : "has exited");
            continue;
        }
        const Fiber& g = L.fibers[base + l];
        if (g.state != AT_WARP) return;
        if (g.op != op || g.mask != mask || (op == EMU_ALLGATHER && g.arg != ref.arg))
            fail("divergent warp collective: lane %u is in %s (mask 0x%08x) while lane %u of its "
                 "mask is in %s (mask 0x%08x)",
                 ref.lin & 31u, op_name(op), mask, l, op_name(g.op), g.mask);
        active |= 1u << l;
    }
    if (op == EMU_ALLGATHER) {
        // Every lane's bytes to every lane now, while all of them still wait (their inputs
        // live in their own stack frames).
        const size_t n = (size_t)ref.arg;
        for (unsigned l = 0; l < 32; ++l) {
            if (!((mask >> l) & 1u)) continue;
            char* out = (char*)L.fibers[base + l].out;
            for (unsigned j = 0; j < 32; ++j)
                if ((mask >> j) & 1u)
                    memcpy(out + j * n, (const void*)(size_t)L.fibers[base + j].value, n);
        }
        for (unsigned l = 0; l < 32; ++l)
            if ((mask >> l) & 1u) L.fibers[base + l].state = READY;
        return;
    }
    unsigned ballot = 0;
    for (unsigned l = 0; l < 32; ++l)
        if (((active >> l) & 1u) && L.fibers[base + l].value) ballot |= 1u << l;
    for (unsigned l = 0; l < 32; ++l) {
        if (!((active >> l) & 1u)) continue;
        Fiber& g = L.fibers[base + l];
        unsigned long long r = 0;
        switch (op) {
            case EMU_SHFL_IDX:
            case EMU_SHFL_UP:
            case EMU_SHFL_DOWN:
            case EMU_SHFL_XOR: {
                const unsigned j = shfl_src(op, l, g.arg, g.width);
                if (!((active >> j) & 1u)) {
                    enter(base + l);  // report it as the reading lane
                    fail("%s (mask 0x%08x) reads lane %u, which %s", op_name(op), mask, j,
                         !((mask >> j) & 1u) ? "is not in the mask"
                         : base + j >= L.n   ? "does not exist"
                                             : "has exited");
                }
                r = L.fibers[base + j].value;
                break;
            }
            case EMU_BALLOT: r = ballot; break;
            case EMU_ANY: r = ballot != 0; break;
            case EMU_ALL: r = ballot == active; break;
            case EMU_MATCH_ANY:
                for (unsigned k = 0; k < 32; ++k)
                    if (((active >> k) & 1u) && L.fibers[base + k].value == g.value) r |= 1ull << k;
                break;
            case EMU_SYNCWARP: break;
            default: {
                // Integer reductions over 32-bit values; arg = 1: signed.
                const bool sgn = g.arg != 0;
                bool first = true;
                unsigned acc = 0;
                for (unsigned k = 0; k < 32; ++k) {
                    if (!((active >> k) & 1u)) continue;
                    const unsigned v = (unsigned)L.fibers[base + k].value;
                    if (first) {
                        acc = v;
                        first = false;
                        continue;
                    }
                    switch (op) {
                        case EMU_REDUCE_ADD: acc += v; break;
                        case EMU_REDUCE_AND: acc &= v; break;
                        case EMU_REDUCE_OR: acc |= v; break;
                        case EMU_REDUCE_XOR: acc ^= v; break;
                        case EMU_REDUCE_MIN:
                            if (sgn ? (int)v < (int)acc : v < acc) acc = v;
                            break;
                        case EMU_REDUCE_MAX:
                            if (sgn ? (int)v > (int)acc : v > acc) acc = v;
                            break;
                    }
                }
                r = acc;
            }
        }
        g.result = r & size_mask(g.size);
    }
    for (unsigned l = 0; l < 32; ++l)
        if ((active >> l) & 1u) L.fibers[base + l].state = READY;
}

void try_complete_barrier() {
    if (L.at_barrier == 0 || L.at_barrier != L.live) return;
    int r = L.bar_kind == EMU_BAR_AND ? 1 : 0;
    for (unsigned i = 0; i < L.n; ++i) {
        const Fiber& f = L.fibers[i];
        if (f.state != AT_BARRIER) continue;
        if (L.bar_kind == EMU_BAR_OR) r |= f.pred;
        else if (L.bar_kind == EMU_BAR_AND) r &= f.pred;
        else if (L.bar_kind == EMU_BAR_COUNT) r += f.pred;
    }
    for (unsigned i = 0; i < L.n; ++i) {
        Fiber& f = L.fibers[i];
        if (f.state != AT_BARRIER) continue;
        f.state = READY;
        f.result = (unsigned long long)(unsigned)r;
    }
    L.at_barrier = 0;
}

[[noreturn]] void thread_exit() {
    Fiber& f = L.fibers[L.cur];
    const unsigned base = f.lin & ~31u;
    f.state = EXITED;
    --L.live;
    // A collective of the warp that waited only for this lane now completes without it.
    for (unsigned l = 0; l < 32 && base + l < L.n; ++l) {
        const Fiber& g = L.fibers[base + l];
        if (g.state == AT_WARP && ((g.mask >> (f.lin & 31u)) & 1u)) try_complete_warp(base / 32, g);
    }
    try_complete_barrier();
    switch_next(false);
    abort();  // not reached: switch_next(false) never returns here
}

void fiber_main() {
    L.body(L.ctx);
    thread_exit();
}

char* new_stack() {
    const size_t len = STACK_BYTES + g_page;
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (m == MAP_FAILED) return nullptr;
    // Stacks grow down: the lowest page is the guard.
    if (mprotect(m, g_page, PROT_NONE) != 0) {
        munmap(m, len);
        return nullptr;
    }
    return (char*)m + g_page;
}

bool dyn_alloc(size_t bytes) {
    const size_t need = (bytes + 15) & ~(size_t)15;
    const size_t body = (need + g_page - 1) / g_page * g_page;
    if (!g_dyn_map || g_dyn_map_len < body + g_page) {
        if (g_dyn_map) munmap(g_dyn_map, g_dyn_map_len);
        g_dyn_map_len = body + g_page;
        void* m = mmap(nullptr, g_dyn_map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                       -1, 0);
        if (m == MAP_FAILED) {
            g_dyn_map = nullptr;
            return false;
        }
        g_dyn_map = (char*)m;
        if (mprotect(g_dyn_map + body, g_page, PROT_NONE) != 0) return false;
    }
    const size_t body_now = g_dyn_map_len - g_page;
    g_dyn = g_dyn_map + body_now - need;
    g_dyn_len = need;
    return true;
}

// Faults inside a launch (an out-of-bounds access, a fiber's stack overflow) name the kernel,
// block and thread before the process dies of the signal as it would have anyway.
struct sigaction g_old_segv, g_old_bus, g_old_fpe;
stack_t g_old_alt;
char g_alt_stack[64 * 1024];

void on_fault(int sig, siginfo_t* si, void*) {
    const char* what = sig == SIGFPE ? "arithmetic fault (integer division by zero?)"
                                     : "invalid memory access";
    const char* a = (const char*)si->si_addr;
    for (char* s : g_stacks)
        if (a >= s - g_page && a < s) what = "stack overflow of the emulated thread";
    if (g_dyn_map && a >= g_dyn + g_dyn_len && a < g_dyn_map + g_dyn_map_len)
        what = "access past the end of the dynamic shared memory";
    char b[768];
    const std::string w = where(L.fibers[L.cur]);
    const int n = snprintf(b, sizeof b, "emu: %s%s at address %p (signal %d)\n", w.c_str(), what,
                           si->si_addr, sig);
    if (n > 0) {
        ssize_t ignored = write(2, b, (size_t)n < sizeof b ? (size_t)n : sizeof b - 1);
        (void)ignored;
    }
    // Back to the previous disposition: the faulting instruction runs again and the process
    // ends the way it would have without the emulator.
    sigaction(SIGSEGV, &g_old_segv, nullptr);
    sigaction(SIGBUS, &g_old_bus, nullptr);
    sigaction(SIGFPE, &g_old_fpe, nullptr);
}

void install_fault_report() {
    stack_t alt;
    alt.ss_sp = g_alt_stack;
    alt.ss_size = sizeof g_alt_stack;
    alt.ss_flags = 0;
    sigaltstack(&alt, &g_old_alt);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sigaction(SIGBUS, &sa, &g_old_bus);
    sigaction(SIGFPE, &sa, &g_old_fpe);
}

void remove_fault_report() {
    sigaction(SIGSEGV, &g_old_segv, nullptr);
    sigaction(SIGBUS, &g_old_bus, nullptr);
    sigaction(SIGFPE, &g_old_fpe, nullptr);
    sigaltstack(&g_old_alt, nullptr);
}

int setup_error(const char* f, ...) {
    va_list ap;
    va_start(ap, f);
    g_error = std::string("emu: kernel `") + L.entry + "`: " + fmt(f, ap);
    va_end(ap);
    return -1;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const char* emu_last_error() {
    return g_error.c_str();
}

extern "C" void* emu_dynamic_shared() { return g_dyn; }

extern "C" unsigned long long emu_warp_op(int op, unsigned mask, unsigned long long value, int arg,
                                          int width, int size) {
    Fiber& f = L.fibers[L.cur];
    const unsigned lane = f.lin & 31u;
    f.op = op;
    f.mask = mask;
    if (!((mask >> lane) & 1u))
        fail("%s with mask 0x%08x, which does not name the calling lane", op_name(op), mask);
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail("%s with width %d (a power of two 1..32)", op_name(op), width);
    f.value = value & size_mask(size);
    f.arg = arg;
    f.width = width;
    f.size = size;
    f.state = AT_WARP;
    try_complete_warp(f.lin / 32, f);
    while (L.fibers[L.cur].state == AT_WARP) switch_next(true);
    return L.fibers[L.cur].result;
}

extern "C" void emu_warp_allgather(unsigned mask, const void* in, int bytes, void* out) {
    Fiber& f = L.fibers[L.cur];
    const unsigned lane = f.lin & 31u;
    f.op = EMU_ALLGATHER;
    f.mask = mask;
    if (!((mask >> lane) & 1u))
        fail("%s with mask 0x%08x, which does not name the calling lane", op_name(EMU_ALLGATHER),
             mask);
    f.value = (unsigned long long)(size_t)in;
    f.arg = bytes;
    f.out = out;
    f.state = AT_WARP;
    try_complete_warp(f.lin / 32, f);
    while (L.fibers[L.cur].state == AT_WARP) switch_next(true);
}

extern "C" int emu_barrier(int kind, int pred) {
    Fiber& f = L.fibers[L.cur];
    if (L.at_barrier == 0) L.bar_kind = kind;
    else if (L.bar_kind != kind)
        fail("%s meets %s of other threads", bar_name(kind), bar_name(L.bar_kind));
    f.state = AT_BARRIER;
    f.bar_kind = kind;
    f.pred = pred;
    ++L.at_barrier;
    try_complete_barrier();
    while (L.fibers[L.cur].state == AT_BARRIER) switch_next(true);
    return (int)L.fibers[L.cur].result;
}

extern "C" void emu_yield() { switch_next(true); }

// Runs `body(ctx)` once per thread of the grid, in the thread's fiber (the body calls the
// kernel entry with its arguments). Returns 0, or -1 with emu_last_error() set.
extern "C" __attribute__((visibility("default"))) int emu_launch(const char* entry, unsigned gx,
                                                                 unsigned gy, unsigned gz,
                                                                 unsigned bx, unsigned by,
                                                                 unsigned bz, size_t dyn_smem,
                                                                 void (*body)(void*), void* ctx) {
    L.entry = entry;
    g_error.clear();
    if (L.running) return setup_error("launched from inside a launch");
    const unsigned long long n = (unsigned long long)bx * by * bz;
    if (n == 0 || n > 1024 || bz > 64)
        return setup_error("block (%u,%u,%u): 1..1024 threads, z <= 64", bx, by, bz);
    if (gx == 0 || gy == 0 || gz == 0 || gx > 0x7fffffffu || gy > 65535 || gz > 65535)
        return setup_error("grid (%u,%u,%u) outside the hardware's limits", gx, gy, gz);
    // The H200's per-block maximum (227 KiB, opted in).
    if (dyn_smem > 227 * 1024)
        return setup_error("%zu bytes of dynamic shared memory (at most 232448)", dyn_smem);
    g_page = (size_t)sysconf(_SC_PAGESIZE);
    while (g_stacks.size() < n) {
        char* s = new_stack();
        if (!s) return setup_error("cannot map a fiber stack");
        g_stacks.push_back(s);
    }
    if (!dyn_alloc(dyn_smem)) return setup_error("cannot map the dynamic shared memory");
    L.n = (unsigned)n;
    L.fibers.assign(n, Fiber());
    L.body = body;
    L.ctx = ctx;
    L.failed = false;
    L.running = true;
    blockDim.x = bx;
    blockDim.y = by;
    blockDim.z = bz;
    gridDim.x = gx;
    gridDim.y = gy;
    gridDim.z = gz;
    install_fault_report();
    const size_t shared_len = (size_t)(__stop_emu_shared - __start_emu_shared);
    for (unsigned z = 0; z < gz && !L.failed; ++z)
        for (unsigned y = 0; y < gy && !L.failed; ++y)
            for (unsigned x = 0; x < gx && !L.failed; ++x) {
                blockIdx.x = x;
                blockIdx.y = y;
                blockIdx.z = z;
                if (shared_len) memset(__start_emu_shared, 0xFF, shared_len);
                memset(g_dyn, 0xFF, g_dyn_len);
                for (unsigned i = 0; i < L.n; ++i) {
                    Fiber& f = L.fibers[i];
                    f.state = READY;
                    f.lin = i;
                    f.tid.x = i % bx;
                    f.tid.y = (i / bx) % by;
                    f.tid.z = i / (bx * by);
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = g_stacks[i];
                    f.ctx.uc_stack.ss_size = STACK_BYTES;
                    f.ctx.uc_link = &L.sched;
                    makecontext(&f.ctx, fiber_main, 0);
                }
                L.live = L.n;
                L.at_barrier = 0;
                enter(0);
                swapcontext(&L.sched, &L.fibers[0].ctx);
            }
    remove_fault_report();
    L.running = false;
    return L.failed ? -1 : 0;
}
