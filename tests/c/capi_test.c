/* libnflash's contract, case by case: null pointers, statuses, calls made
 * from inside a token callback, what nflash_cancel means before, during and
 * after a call, nflash_reset, a callback that stops, the verify option.
 *
 *   python3 tests/c/damage_pack.py models/smollm2-q8_0.nflash damaged.nflash
 *   cc -Wall -Wextra -Werror tests/c/capi_test.c -Icapi/include target/release/libnflash.a \
 *       -lpthread -ldl -lm -o capi-test
 *   ./capi-test models/smollm2-q8_0.nflash damaged.nflash [CASE]
 *
 * PACK is the demo pack, DAMAGED a copy with one byte of a neuron cluster
 * flipped; CASE runs only the case of that name. Prints
 * "ok   NAME" or "FAIL NAME: why" for each case and exits 1 if any failed.
 * A case that hangs (a deadlock) fails after CASE_TIMEOUT seconds.
 * make test runs it against the static library. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash.h"

#ifndef CASE_TIMEOUT
#define CASE_TIMEOUT 120
#endif

static const char *pack_path, *damaged_path;
static nflash_model *model;     /* the demo pack, open for the whole run */
static nflash_params greedy;    /* temperature 0, 8 tokens */
static const char *current = ""; /* the running case */
static int case_failed;

/* Fails the running case (and returns from it) unless `cond` holds. */
#define CHECK(cond, ...)                                                                    \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            fprintf(stderr, "FAIL %s: ", current);                                          \
            fprintf(stderr, __VA_ARGS__);                                                   \
            fprintf(stderr, " [line %d, last error: \"%s\"]\n", __LINE__, nflash_last_error()); \
            case_failed = 1;                                                                \
            return;                                                                         \
        }                                                                                   \
    } while (0)

/* As CHECK, for a call's status. */
#define CHECK_STATUS(call, want)                                                                  \
    do {                                                                                          \
        nflash_status got_ = (call);                                                              \
        CHECK(got_ == (want), "%s returned status %d, expected %s (%d)", #call, (int)got_, #want, \
              (int)(want));                                                                       \
    } while (0)

/* A failed call left a message. */
#define CHECK_ERROR_NAMES(word) \
    CHECK(strstr(nflash_last_error(), (word)) != NULL, "the last error does not name \"%s\"", (word))

static void on_alarm(int sig) {
    (void)sig;
    static const char a[] = "FAIL ", b[] = ": timed out (a deadlock?)\n";
    if (write(2, a, sizeof a - 1) < 0 || write(2, current, strlen(current)) < 0 || write(2, b, sizeof b - 1) < 0) {
    }
    _exit(1);
}

/* Text delivered to a callback. */
struct collect {
    char text[8192];
    size_t len;
    atomic_int pieces;
    int stop_after; /* return false at this piece (0: never) */
    int after_stop; /* pieces delivered after returning false */
    int stopped;
};

static bool collect_cb(const char *piece, size_t len, void *user) {
    struct collect *c = user;
    if (c->stopped) c->after_stop++;
    if (strlen(piece) != len) c->after_stop += 1000; /* NUL-terminated at len */
    if (c->len + len < sizeof c->text) {
        memcpy(c->text + c->len, piece, len);
        c->len += len;
        c->text[c->len] = '\0';
    }
    int n = atomic_fetch_add(&c->pieces, 1) + 1;
    if (c->stop_after && n >= c->stop_after) {
        c->stopped = 1;
        return false;
    }
    return true;
}

/* ---- null pointers and statuses (issue 43 §3 item 3, item 4) ---- */

static void t_null_pointers(void) {
    nflash_options o;
    nflash_params p;
    nflash_stats_t st;
    nflash_message ok[] = {{"user", "Hi"}};
    nflash_message no_role[] = {{NULL, "Hi"}};
    nflash_message no_content[] = {{"user", NULL}};

    CHECK_STATUS(nflash_options_default(NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("out");

    nflash_model *m = (nflash_model *)&o; /* not null: a failed open must set it to NULL */
    CHECK_STATUS(nflash_open(NULL, NULL, &m), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("path");
    CHECK(m == NULL, "a failed nflash_open left *out as it was");
    CHECK_STATUS(nflash_open(pack_path, NULL, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("out");

    CHECK_STATUS(nflash_params_default(NULL, &p), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("model");
    CHECK_STATUS(nflash_params_default(model, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("out");

    CHECK_STATUS(nflash_chat(NULL, ok, 1, &greedy, NULL, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("model");
    CHECK_STATUS(nflash_chat(model, NULL, 1, &greedy, NULL, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("messages");
    CHECK_STATUS(nflash_chat(model, NULL, 0, &greedy, NULL, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("messages");
    CHECK_STATUS(nflash_chat(model, no_role, 1, &greedy, NULL, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("messages[0].role");
    CHECK_STATUS(nflash_chat(model, no_content, 1, &greedy, NULL, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("messages[0].content");

    CHECK_STATUS(nflash_complete(NULL, "Hi", &greedy, NULL, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("model");
    CHECK_STATUS(nflash_complete(model, NULL, &greedy, NULL, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("prompt");

    CHECK_STATUS(nflash_cancel(NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("model");
    CHECK_STATUS(nflash_stats(NULL, &st), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("model");
    CHECK_STATUS(nflash_stats(model, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("out");
    CHECK_STATUS(nflash_reset(NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("model");
    nflash_free(NULL); /* does nothing */

    /* Null params and callback are allowed (the defaults; no text delivered). */
    nflash_params one = greedy;
    one.max_tokens = 1;
    CHECK_STATUS(nflash_complete(model, "Hi", &one, NULL, NULL), NFLASH_STATUS_OK);
    /* The model still works after all that. */
    CHECK_STATUS(nflash_chat(model, ok, 1, &one, NULL, NULL), NFLASH_STATUS_OK);
}

static void t_status_kinds(void) {
    nflash_options o;
    nflash_options_default(&o);
    nflash_model *m = NULL;
    o.memory_budget_bytes = 1 << 20; /* 1 MiB cannot hold the model */
    CHECK_STATUS(nflash_open(pack_path, &o, &m), NFLASH_STATUS_MEMORY);
    CHECK_ERROR_NAMES("budget");
    CHECK(m == NULL, "a failed open gave a model");
    nflash_options_default(&o);
    o.ctx = 1;
    CHECK_STATUS(nflash_open(pack_path, &o, &m), NFLASH_STATUS_INVALID_ARGUMENT);
    nflash_options_default(&o);
    o.verify = 3;
    CHECK_STATUS(nflash_open(pack_path, &o, &m), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(nflash_open("/nonexistent.nflash", NULL, &m), NFLASH_STATUS_IO);
    CHECK_STATUS(nflash_open("/", NULL, &m), NFLASH_STATUS_IO);
    CHECK_STATUS(nflash_open("/proc/self/exe", NULL, &m), NFLASH_STATUS_PACK);

    nflash_params p = greedy;
    p.max_tokens = 0;
    CHECK_STATUS(nflash_complete(model, "Hi", &p, NULL, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    p = greedy;
    p.top_p = 2;
    CHECK_STATUS(nflash_complete(model, "Hi", &p, NULL, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(nflash_complete(model, "", &greedy, NULL, NULL), NFLASH_STATUS_PROMPT);
    nflash_message one[] = {{"user", "Hi"}};
    CHECK_STATUS(nflash_chat(model, one, 0, &greedy, NULL, NULL), NFLASH_STATUS_PROMPT);
    nflash_message wizard[] = {{"wizard", "Hi"}};
    CHECK_STATUS(nflash_chat(model, wizard, 1, &greedy, NULL, NULL), NFLASH_STATUS_PROMPT);
}

/* ---- calls from inside a token callback (item 1) ---- */

enum reenter_what { R_STATS, R_PARAMS, R_RESET, R_CHAT, R_COMPLETE, R_CANCEL, R_FREE, R_OTHER_MODEL };

struct reenter {
    enum reenter_what what;
    int pieces;
    nflash_status status, status2;
    char error[512];
    nflash_stats_t stats;
    nflash_params params;
    nflash_model *other;
};

static bool inner_cb(const char *piece, size_t len, void *user);

/* On the first piece, calls into the library as `what` says. */
static bool reenter_cb(const char *piece, size_t len, void *user) {
    struct reenter *r = user;
    (void)piece;
    (void)len;
    if (r->pieces++ > 0) return true;
    nflash_message hi[] = {{"user", "Hi"}};
    switch (r->what) {
    case R_STATS: r->status = nflash_stats(model, &r->stats); break;
    case R_PARAMS: r->status = nflash_params_default(model, &r->params); break;
    case R_RESET: r->status = nflash_reset(model); break;
    case R_CHAT: r->status = nflash_chat(model, hi, 1, &greedy, NULL, NULL); break;
    case R_COMPLETE: r->status = nflash_complete(model, "Hi", &greedy, NULL, NULL); break;
    case R_CANCEL: r->status = nflash_cancel(model); break;
    case R_FREE:
        nflash_free(model);
        r->status = NFLASH_STATUS_OK;
        break;
    case R_OTHER_MODEL: r->status = nflash_complete(r->other, "Hi", &greedy, inner_cb, r); break;
    }
    snprintf(r->error, sizeof r->error, "%s", nflash_last_error());
    return true;
}

/* The second model's callback, inside the first's: the first is still busy. */
static bool inner_cb(const char *piece, size_t len, void *user) {
    struct reenter *r = user;
    (void)piece;
    (void)len;
    if (r->pieces++ == 1) r->status2 = nflash_reset(model);
    return true;
}

/* Runs a greedy completion whose callback re-enters as `what`; returns its status. */
static nflash_status reenter(struct reenter *r, enum reenter_what what) {
    memset(r, 0, sizeof *r);
    r->what = what;
    r->status = -1;
    return nflash_complete(model, "The capital of France is", &greedy, reenter_cb, r);
}

static void t_callback_calls_stats(void) {
    nflash_stats_t before;
    CHECK_STATUS(nflash_complete(model, "Hello", &greedy, NULL, NULL), NFLASH_STATUS_OK);
    CHECK_STATUS(nflash_stats(model, &before), NFLASH_STATUS_OK);
    struct reenter r;
    CHECK_STATUS(reenter(&r, R_STATS), NFLASH_STATUS_OK);
    CHECK(r.status == NFLASH_STATUS_OK, "nflash_stats from a callback: status %d (%s)", (int)r.status, r.error);
    /* The figures of the last finished generation. */
    CHECK(r.stats.prompt_tokens == before.prompt_tokens && r.stats.generated_tokens == before.generated_tokens,
          "nflash_stats from a callback gave %u/%u tokens, the last generation had %u/%u", r.stats.prompt_tokens,
          r.stats.generated_tokens, before.prompt_tokens, before.generated_tokens);
}

static void t_callback_calls_params_default(void) {
    struct reenter r;
    nflash_params want;
    CHECK_STATUS(nflash_params_default(model, &want), NFLASH_STATUS_OK);
    CHECK_STATUS(reenter(&r, R_PARAMS), NFLASH_STATUS_OK);
    CHECK(r.status == NFLASH_STATUS_OK, "nflash_params_default from a callback: status %d (%s)", (int)r.status,
          r.error);
    CHECK(memcmp(&r.params, &want, sizeof want) == 0, "other defaults inside a callback");
}

static void t_callback_calls_reset(void) {
    struct reenter r;
    CHECK_STATUS(reenter(&r, R_RESET), NFLASH_STATUS_OK);
    CHECK(r.status == NFLASH_STATUS_BUSY, "nflash_reset from a callback: status %d, expected BUSY", (int)r.status);
    CHECK(strstr(r.error, "callback") != NULL, "BUSY's message does not say why: \"%s\"", r.error);
    CHECK(r.pieces > 1, "the generation stopped after the refused call (%d pieces)", r.pieces);
}

static void t_callback_calls_chat(void) {
    struct reenter r;
    CHECK_STATUS(reenter(&r, R_CHAT), NFLASH_STATUS_OK);
    CHECK(r.status == NFLASH_STATUS_BUSY, "nflash_chat from a callback: status %d, expected BUSY", (int)r.status);
    CHECK(strstr(r.error, "callback") != NULL, "BUSY's message does not say why: \"%s\"", r.error);
}

static void t_callback_calls_complete(void) {
    struct reenter r;
    CHECK_STATUS(reenter(&r, R_COMPLETE), NFLASH_STATUS_OK);
    CHECK(r.status == NFLASH_STATUS_BUSY, "nflash_complete from a callback: status %d, expected BUSY",
          (int)r.status);
    /* And the model works afterwards. */
    CHECK_STATUS(nflash_complete(model, "Hi", &greedy, NULL, NULL), NFLASH_STATUS_OK);
}

static void t_callback_calls_cancel(void) {
    struct reenter r;
    nflash_params p = greedy;
    p.max_tokens = 64;
    memset(&r, 0, sizeof r);
    r.what = R_CANCEL;
    CHECK_STATUS(nflash_complete(model, "Once upon a time", &p, reenter_cb, &r), NFLASH_STATUS_CANCELLED);
    CHECK(r.status == NFLASH_STATUS_OK, "nflash_cancel from a callback: status %d", (int)r.status);
    nflash_stats_t st;
    CHECK_STATUS(nflash_stats(model, &st), NFLASH_STATUS_OK);
    CHECK(st.generated_tokens < 64, "cancelled from the callback yet %u tokens generated", st.generated_tokens);
}

static void t_callback_uses_another_model(void) {
    nflash_options o;
    nflash_options_default(&o);
    o.ctx = 256;
    struct reenter r;
    nflash_model *other = NULL;
    CHECK_STATUS(nflash_open(pack_path, &o, &other), NFLASH_STATUS_OK);
    memset(&r, 0, sizeof r);
    r.what = R_OTHER_MODEL;
    r.other = other;
    r.status = r.status2 = -1;
    nflash_status s = nflash_complete(model, "The capital of France is", &greedy, reenter_cb, &r);
    nflash_free(other);
    CHECK(s == NFLASH_STATUS_OK, "outer call: status %d", (int)s);
    CHECK(r.status == NFLASH_STATUS_OK, "a call on another model from a callback: status %d (%s)", (int)r.status,
          r.error);
    CHECK(r.status2 == NFLASH_STATUS_BUSY, "nflash_reset of the outer model from the inner callback: status %d",
          (int)r.status2);
}

static void t_callback_frees_model(void) {
    struct reenter r;
    CHECK_STATUS(reenter(&r, R_FREE), NFLASH_STATUS_OK);
    CHECK(strstr(r.error, "callback") != NULL, "nflash_free from a callback left no message: \"%s\"", r.error);
    /* Not freed: the model still works. */
    CHECK_STATUS(nflash_complete(model, "Hi", &greedy, NULL, NULL), NFLASH_STATUS_OK);
}

/* ---- nflash_cancel before, during and after a call (item 2) ---- */

static void t_cancel_before_a_call_is_forgotten(void) {
    CHECK_STATUS(nflash_cancel(model), NFLASH_STATUS_OK); /* nothing runs */
    struct collect c = {0};
    CHECK_STATUS(nflash_complete(model, "Once upon a time", &greedy, collect_cb, &c), NFLASH_STATUS_OK);
    nflash_stats_t st;
    nflash_stats(model, &st);
    CHECK(st.generated_tokens == greedy.max_tokens, "%u of %u tokens after an earlier cancel", st.generated_tokens,
          greedy.max_tokens);
}

struct holder {
    atomic_int started, release;
    nflash_status status;
};

/* Holds the model (the call is in its callback) until released. */
static bool hold_cb(const char *piece, size_t len, void *user) {
    struct holder *h = user;
    (void)piece;
    (void)len;
    atomic_store(&h->started, 1);
    while (!atomic_load(&h->release)) usleep(1000);
    return true;
}

static void *run_holder(void *arg) {
    struct holder *h = arg;
    nflash_params p = greedy;
    p.max_tokens = 64;
    h->status = nflash_complete(model, "Once upon a time", &p, hold_cb, h);
    return NULL;
}

struct waiter {
    struct collect c;
    nflash_status status;
};

static void *run_waiter(void *arg) {
    struct waiter *w = arg;
    w->status = nflash_complete(model, "The weather today", &greedy, collect_cb, &w->c);
    return NULL;
}

/* A call waiting for the model (another call runs) when nflash_cancel comes
 * is cancelled too, before it computes anything. */
static void t_cancel_while_a_call_waits(void) {
    struct holder h = {0};
    struct waiter w = {0};
    pthread_t a, b;
    pthread_create(&a, NULL, run_holder, &h);
    while (!atomic_load(&h.started)) usleep(1000);
    pthread_create(&b, NULL, run_waiter, &w);
    usleep(300 * 1000); /* b is now waiting for the model */
    nflash_status s = nflash_cancel(model);
    atomic_store(&h.release, 1);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    CHECK(s == NFLASH_STATUS_OK, "nflash_cancel: status %d", (int)s);
    CHECK(h.status == NFLASH_STATUS_CANCELLED, "the running call: status %d, expected CANCELLED", (int)h.status);
    CHECK(w.status == NFLASH_STATUS_CANCELLED, "the waiting call: status %d, expected CANCELLED", (int)w.status);
    CHECK(atomic_load(&w.c.pieces) == 0, "the waiting call delivered %d pieces", atomic_load(&w.c.pieces));
    nflash_stats_t st;
    nflash_stats(model, &st);
    CHECK(st.generated_tokens == 0, "the waiting call generated %u tokens", st.generated_tokens);
}

struct canceller {
    struct collect *c;
    int after;
};

static void *cancel_after(void *arg) {
    struct canceller *k = arg;
    while (atomic_load(&k->c->pieces) < k->after) usleep(500);
    nflash_cancel(model);
    return NULL;
}

/* A cancel during a generation stops it; the next call is not affected. */
static void t_cancel_during_then_after(void) {
    struct collect c = {0};
    struct canceller k = {&c, 3};
    nflash_params p = greedy;
    p.max_tokens = 200;
    pthread_t t;
    pthread_create(&t, NULL, cancel_after, &k);
    nflash_status s = nflash_complete(model, "Once upon a time", &p, collect_cb, &c);
    pthread_join(t, NULL);
    CHECK(s == NFLASH_STATUS_CANCELLED, "cancelled during generation: status %d", (int)s);
    CHECK(strstr(nflash_last_error(), "cancelled by nflash_cancel") != NULL, "last error after a cancel: %s",
          nflash_last_error());
    nflash_stats_t st;
    nflash_stats(model, &st);
    CHECK(st.generated_tokens >= 3 && st.generated_tokens < 200, "cancelled after %u tokens", st.generated_tokens);
    /* After the call: a cancel now (nothing runs) and the next call runs whole. */
    CHECK_STATUS(nflash_cancel(model), NFLASH_STATUS_OK);
    struct collect d = {0};
    CHECK_STATUS(nflash_complete(model, "Once upon a time", &greedy, collect_cb, &d), NFLASH_STATUS_OK);
    nflash_stats(model, &st);
    CHECK(st.generated_tokens == greedy.max_tokens, "the next call generated %u of %u tokens", st.generated_tokens,
          greedy.max_tokens);
}

/* ---- reset, a callback that stops, verify (item 4) ---- */

static void t_reset(void) {
    struct collect first = {0}, second = {0}, third = {0};
    nflash_stats_t st;
    /* Longer than a prefill pass (256 tokens for SmolLM2): the KV cache is
       reused by whole passes. */
    static char system[4096];
    system[0] = '\0';
    for (int i = 0; i < 24; i++) strcat(system, "Answer in one short sentence, naming places exactly. ");
    nflash_message q1[] = {{"system", system}, {"user", "What is the capital of France?"}};
    CHECK_STATUS(nflash_chat(model, q1, 2, &greedy, collect_cb, &first), NFLASH_STATUS_OK);
    nflash_message q2[] = {{"system", system}, {"user", "What is the capital of France?"}, {"assistant", first.text},
                           {"user", "And of Germany?"}};
    CHECK_STATUS(nflash_chat(model, q2, 4, &greedy, collect_cb, &second), NFLASH_STATUS_OK);
    nflash_stats(model, &st);
    CHECK(st.reused_tokens > 0, "the second turn reused none of its %u prompt tokens", st.prompt_tokens);
    CHECK_STATUS(nflash_reset(model), NFLASH_STATUS_OK);
    CHECK_STATUS(nflash_chat(model, q2, 4, &greedy, collect_cb, &third), NFLASH_STATUS_OK);
    nflash_stats(model, &st);
    CHECK(st.reused_tokens == 0, "after nflash_reset %u tokens were reused", st.reused_tokens);
    CHECK(strcmp(second.text, third.text) == 0, "greedy text differs after a reset: \"%s\" vs \"%s\"", second.text,
          third.text);
}

static void t_callback_stops(void) {
    struct collect c = {0};
    c.stop_after = 3;
    nflash_params p = greedy;
    p.max_tokens = 200;
    CHECK_STATUS(nflash_complete(model, "Once upon a time", &p, collect_cb, &c), NFLASH_STATUS_OK);
    CHECK(atomic_load(&c.pieces) == 3, "%d pieces delivered, the callback stopped at the 3rd",
          atomic_load(&c.pieces));
    CHECK(c.after_stop == 0, "a piece after the callback returned false (or one not NUL-terminated)");
    nflash_stats_t st;
    nflash_stats(model, &st);
    CHECK(st.generated_tokens >= 3 && st.generated_tokens < 200, "%u tokens generated", st.generated_tokens);
}

static void t_verify(void) {
    nflash_options o;
    nflash_model *m = NULL;
    nflash_options_default(&o);
    o.verify = 1; /* full: every segment at open */
    CHECK_STATUS(nflash_open(damaged_path, &o, &m), NFLASH_STATUS_PACK);
    CHECK_ERROR_NAMES("checksum");
    CHECK(m == NULL, "a failed open gave a model");
    o.verify = 0; /* lazy: each neuron cluster as it is read (all, at open, without a budget) */
    CHECK_STATUS(nflash_open(damaged_path, &o, &m), NFLASH_STATUS_PACK);
    CHECK_ERROR_NAMES("neuron cluster");
    o.verify = 2; /* off: the damage goes unnoticed */
    CHECK_STATUS(nflash_open(damaged_path, &o, &m), NFLASH_STATUS_OK);
    nflash_status s = nflash_complete(m, "Hi", &greedy, NULL, NULL);
    nflash_free(m);
    CHECK(s == NFLASH_STATUS_OK, "generation with checks off: status %d", (int)s);
    /* The undamaged pack passes the full check. */
    m = NULL;
    o.verify = 1;
    CHECK_STATUS(nflash_open(pack_path, &o, &m), NFLASH_STATUS_OK);
    nflash_free(m);
}

/* ---- params.enable_thinking (issue 44: the Qwen3 thinking switch) ---- */

static void t_enable_thinking(void) {
    nflash_params p;
    nflash_message msgs[] = {{"user", "What is the capital of France?"}};
    CHECK_STATUS(nflash_params_default(model, &p), NFLASH_STATUS_OK);
    CHECK(p.enable_thinking == -1, "params_default gave enable_thinking %d, expected -1", p.enable_thinking);
    p = greedy;
    p.enable_thinking = 7;
    CHECK_STATUS(nflash_chat(model, msgs, 1, &p, NULL, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("enable_thinking");
    /* SmolLM2's template does not read it: off gives the default's text. */
    struct collect a = {0}, b = {0};
    p.enable_thinking = -1;
    CHECK_STATUS(nflash_chat(model, msgs, 1, &p, collect_cb, &a), NFLASH_STATUS_OK);
    p.enable_thinking = 0;
    CHECK_STATUS(nflash_chat(model, msgs, 1, &p, collect_cb, &b), NFLASH_STATUS_OK);
    CHECK(a.len > 0 && strcmp(a.text, b.text) == 0, "enable_thinking 0 changed SmolLM2's reply: \"%s\" vs \"%s\"",
          a.text, b.text);
}

/* ---- speculative decoding (issue 47): the same text, drafts counted ---- */

static void t_speculate(void) {
    nflash_params p;
    nflash_stats_t st;
    CHECK_STATUS(nflash_params_default(model, &p), NFLASH_STATUS_OK);
    CHECK(p.speculate_draft == 3 && p.draft_tokens == 0, "params_default: draft %u (want 3, auto), K %u (want 0: 4)",
          p.speculate_draft, p.draft_tokens);
    p = greedy;
    p.max_tokens = 48;
    const char *doc = "The river flows past the old mill. The river flows past the old mill. "
                      "The river flows past the old mill. The river";
    struct collect plain = {0}, spec = {0};
    CHECK_STATUS(nflash_complete(model, doc, &p, collect_cb, &plain), NFLASH_STATUS_OK);
    CHECK_STATUS(nflash_stats(model, &st), NFLASH_STATUS_OK);
    CHECK(st.draft_tokens == 0 && st.accepted_tokens == 0, "drafted %u without a draft", st.draft_tokens);
    p.speculate_draft = 1;
    p.draft_tokens = 6;
    CHECK_STATUS(nflash_complete(model, doc, &p, collect_cb, &spec), NFLASH_STATUS_OK);
    CHECK(strcmp(plain.text, spec.text) == 0, "lookup changed the text: \"%s\" vs \"%s\"", plain.text, spec.text);
    CHECK_STATUS(nflash_stats(model, &st), NFLASH_STATUS_OK);
    CHECK(st.draft_tokens > 0 && st.accepted_tokens <= st.draft_tokens && st.decode_passes > 0,
          "drafted %u, accepted %u, passes %u", st.draft_tokens, st.accepted_tokens, st.decode_passes);
    struct collect self_spec = {0};
    p.speculate_draft = 2;
    CHECK_STATUS(nflash_complete(model, doc, &p, collect_cb, &self_spec), NFLASH_STATUS_OK);
    CHECK(strcmp(plain.text, self_spec.text) == 0, "self-speculation changed the text: \"%s\" vs \"%s\"", plain.text,
          self_spec.text);
    CHECK_STATUS(nflash_stats(model, &st), NFLASH_STATUS_OK);
    CHECK(st.draft_tokens > 0 && st.accepted_tokens <= st.draft_tokens, "self: drafted %u, accepted %u",
          st.draft_tokens, st.accepted_tokens);
    struct collect auto_spec = {0};
    p.speculate_draft = 3;
    CHECK_STATUS(nflash_complete(model, doc, &p, collect_cb, &auto_spec), NFLASH_STATUS_OK);
    CHECK(strcmp(plain.text, auto_spec.text) == 0, "auto changed the text: \"%s\" vs \"%s\"", plain.text,
          auto_spec.text);
    p.speculate_draft = 4;
    CHECK_STATUS(nflash_complete(model, doc, &p, NULL, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("speculate_draft");
    p.speculate_draft = 1;
    p.draft_tokens = 17;
    CHECK_STATUS(nflash_complete(model, doc, &p, NULL, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("draft_tokens");

    /* A draft pack (options.draft_path; here the pack itself, whose greedy
       guesses are all kept): 4 and auto give the same text. */
    nflash_options o;
    nflash_options_default(&o);
    CHECK(o.draft_path == NULL, "options_default: a draft path");
    o.ctx = 1024;
    o.draft_path = "/nonexistent.nflash";
    nflash_model *drafted = NULL;
    CHECK_STATUS(nflash_open(pack_path, &o, &drafted), NFLASH_STATUS_IO);
    CHECK_ERROR_NAMES("nonexistent.nflash");
    CHECK_ERROR_NAMES("draft pack");
    o.draft_path = "";
    CHECK_STATUS(nflash_open(pack_path, &o, &drafted), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_ERROR_NAMES("draft_path");
    o.draft_path = pack_path;
    CHECK_STATUS(nflash_open(pack_path, &o, &drafted), NFLASH_STATUS_OK);
    if (!drafted) return;
    for (unsigned kind = 3; kind <= 4; kind++) {
        struct collect pack_spec = {0};
        p.speculate_draft = kind;
        p.draft_tokens = 4;
        CHECK_STATUS(nflash_complete(drafted, doc, &p, collect_cb, &pack_spec), NFLASH_STATUS_OK);
        CHECK(strcmp(plain.text, pack_spec.text) == 0, "draft pack (%u) changed the text: \"%s\" vs \"%s\"", kind,
              plain.text, pack_spec.text);
        CHECK_STATUS(nflash_stats(drafted, &st), NFLASH_STATUS_OK);
        /* auto never drafts in memory (a verify pass costs what it saves). */
        CHECK(kind == 3 ? st.draft_tokens == 0 : st.draft_tokens > 0 && st.accepted_tokens == st.draft_tokens,
              "draft pack (%u): drafted %u, accepted %u (the model itself: all; auto in memory: none)", kind,
              st.draft_tokens, st.accepted_tokens);
    }
    nflash_free(drafted);
}

/* ---- memory given back on request (issue 46: onTrimMemory) ---- */

static bool trim_cb(const char *piece, size_t len, void *user) {
    struct collect *c = user;
    /* Mid-generation, from the callback: the floor, then the cap lifted. */
    int n = atomic_load(&c->pieces);
    if (n == 2 && nflash_trim_memory_level(model, 40) != NFLASH_STATUS_OK) c->after_stop += 100;
    if (n == 5 && nflash_trim_memory_level(model, 0) != NFLASH_STATUS_OK) c->after_stop += 100;
    return collect_cb(piece, len, user);
}

static void t_trim_memory(void) {
    nflash_memory_t mem;
    nflash_message msgs[] = {{"user", "What is the capital of France?"}};
    struct collect full = {0}, at_floor = {0}, squeezed = {0};
    CHECK_STATUS(nflash_trim_memory_to(NULL, 0), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(nflash_memory(model, NULL), NFLASH_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(nflash_memory(model, &mem), NFLASH_STATUS_OK);
    CHECK(mem.floor_bytes > 0 && mem.floor_bytes < mem.ceiling_bytes && mem.held_bytes == mem.ceiling_bytes,
          "held %llu, floor %llu, ceiling %llu", (unsigned long long)mem.held_bytes,
          (unsigned long long)mem.floor_bytes, (unsigned long long)mem.ceiling_bytes);
    CHECK_STATUS(nflash_chat(model, msgs, 1, &greedy, collect_cb, &full), NFLASH_STATUS_OK);
    /* No generation runs: the floor at once. */
    CHECK_STATUS(nflash_trim_memory_to(model, 0), NFLASH_STATUS_OK);
    nflash_memory(model, &mem);
    CHECK(mem.held_bytes == mem.floor_bytes, "after a trim to 0 the cache holds %llu, its floor is %llu",
          (unsigned long long)mem.held_bytes, (unsigned long long)mem.floor_bytes);
    CHECK_STATUS(nflash_reset(model), NFLASH_STATUS_OK);
    CHECK_STATUS(nflash_chat(model, msgs, 1, &greedy, collect_cb, &at_floor), NFLASH_STATUS_OK);
    CHECK(strcmp(full.text, at_floor.text) == 0, "at the floor the reply differs: \"%s\" vs \"%s\"", full.text,
          at_floor.text);
    nflash_memory(model, &mem);
    CHECK(mem.held_bytes == mem.floor_bytes, "the cap was not kept: %llu held", (unsigned long long)mem.held_bytes);
    CHECK_STATUS(nflash_trim_memory_to(model, UINT64_MAX), NFLASH_STATUS_OK);
    nflash_memory(model, &mem);
    CHECK(mem.held_bytes == mem.ceiling_bytes, "lifting the cap left %llu of %llu", (unsigned long long)mem.held_bytes,
          (unsigned long long)mem.ceiling_bytes);
    /* Trims from the token callback of a running generation. */
    CHECK_STATUS(nflash_reset(model), NFLASH_STATUS_OK);
    CHECK_STATUS(nflash_chat(model, msgs, 1, &greedy, trim_cb, &squeezed), NFLASH_STATUS_OK);
    CHECK(squeezed.after_stop == 0, "a trim from the callback failed");
    CHECK(strcmp(full.text, squeezed.text) == 0, "squeezed mid-reply the text differs: \"%s\" vs \"%s\"", full.text,
          squeezed.text);
    nflash_memory(model, &mem);
    CHECK(mem.held_bytes == mem.ceiling_bytes, "after level 0 the cache holds %llu of %llu",
          (unsigned long long)mem.held_bytes, (unsigned long long)mem.ceiling_bytes);
}

/* memory_budget_bytes UINT64_MAX: the budget follows the memory free (--memory-budget auto). */
static void t_memory_auto(void) {
    nflash_options o;
    nflash_model *m = NULL;
    nflash_memory_t mem;
    nflash_message msgs[] = {{"user", "What is the capital of France?"}};
    struct collect want = {0}, got = {0};
    CHECK_STATUS(nflash_chat(model, msgs, 1, &greedy, collect_cb, &want), NFLASH_STATUS_OK);
    CHECK_STATUS(nflash_reset(model), NFLASH_STATUS_OK);
    nflash_options_default(&o);
    o.memory_budget_bytes = UINT64_MAX;
    CHECK_STATUS(nflash_open(pack_path, &o, &m), NFLASH_STATUS_OK);
    if (!m) return;
    CHECK_STATUS(nflash_memory(m, &mem), NFLASH_STATUS_OK);
    CHECK(mem.floor_bytes < mem.ceiling_bytes && mem.held_bytes <= mem.ceiling_bytes, "held %llu, floor %llu, ceiling %llu",
          (unsigned long long)mem.held_bytes, (unsigned long long)mem.floor_bytes, (unsigned long long)mem.ceiling_bytes);
    CHECK_STATUS(nflash_chat(m, msgs, 1, &greedy, collect_cb, &got), NFLASH_STATUS_OK);
    CHECK(strcmp(want.text, got.text) == 0, "with the budget auto the reply differs: \"%s\" vs \"%s\"", want.text,
          got.text);
    nflash_free(m);
}

static const struct {
    const char *name;
    void (*run)(void);
} cases[] = {
    {"memory_auto", t_memory_auto},
    {"null_pointers", t_null_pointers},
    {"status_kinds", t_status_kinds},
    {"callback_calls_stats", t_callback_calls_stats},
    {"callback_calls_params_default", t_callback_calls_params_default},
    {"callback_calls_reset", t_callback_calls_reset},
    {"callback_calls_chat", t_callback_calls_chat},
    {"callback_calls_complete", t_callback_calls_complete},
    {"callback_calls_cancel", t_callback_calls_cancel},
    {"callback_uses_another_model", t_callback_uses_another_model},
    {"callback_frees_model", t_callback_frees_model},
    {"cancel_before_a_call_is_forgotten", t_cancel_before_a_call_is_forgotten},
    {"cancel_while_a_call_waits", t_cancel_while_a_call_waits},
    {"cancel_during_then_after", t_cancel_during_then_after},
    {"reset", t_reset},
    {"callback_stops", t_callback_stops},
    {"verify", t_verify},
    {"enable_thinking", t_enable_thinking},
    {"speculate", t_speculate},
    {"trim_memory", t_trim_memory},
};

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s PACK DAMAGED_PACK [CASE]\n", argv[0]);
        return 2;
    }
    pack_path = argv[1];
    damaged_path = argv[2];
    const char *only = argc > 3 ? argv[3] : NULL;
    signal(SIGALRM, on_alarm);
    printf("libnflash %s\n", nflash_version());

    nflash_options o;
    nflash_options_default(&o);
    o.ctx = 1024;
    nflash_status s = nflash_open(pack_path, &o, &model);
    if (s != NFLASH_STATUS_OK) {
        fprintf(stderr, "capi-test: nflash_open %s failed (status %d): %s\n", pack_path, (int)s, nflash_last_error());
        return 1;
    }
    nflash_params_default(model, &greedy);
    greedy.temperature = 0;
    greedy.max_tokens = 8;

    int failed = 0, ran = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (only && strcmp(cases[i].name, only) != 0) continue;
        current = cases[i].name;
        case_failed = 0;
        alarm(CASE_TIMEOUT);
        cases[i].run();
        alarm(0);
        ran++;
        if (case_failed)
            failed++;
        else
            printf("ok   %s\n", current);
        fflush(stdout);
        fflush(stderr);
    }
    nflash_free(model);
    printf("%d of %d cases passed\n", ran - failed, ran);
    return failed ? 1 : 0;
}
