/* libnflash from C: open a pack, ask a question through the chat template
 * with the text streamed to stdout, continue the conversation (reusing the
 * KV cache), then cancel a long completion from another thread.
 *
 *   cc examples/chat.c -Icapi/include target/release/libnflash.a -lpthread -ldl -lm -o chat
 *   ./chat models/smollm2-q8_0.nflash [memory budget in MiB]
 *
 * Exit status 0 when every step behaved as documented (make test checks it). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash.h"

struct reply {
    char text[4096];
    size_t len;
    atomic_int pieces;
};

static bool on_token(const char *piece, size_t len, void *user) {
    struct reply *r = user;
    fwrite(piece, 1, len, stdout);
    fflush(stdout);
    if (r->len + len < sizeof r->text) {
        memcpy(r->text + r->len, piece, len);
        r->len += len;
        r->text[r->len] = '\0';
    }
    atomic_fetch_add(&r->pieces, 1);
    return true;
}

struct canceller {
    nflash_model *model;
    struct reply *reply;
};

/* Waits for the fifth piece of text, then cancels the generation. */
static void *cancel_soon(void *arg) {
    struct canceller *c = arg;
    while (atomic_load(&c->reply->pieces) < 5) usleep(1000);
    nflash_cancel(c->model);
    return NULL;
}

static int fail(const char *what, nflash_status s) {
    fprintf(stderr, "chat: %s failed (status %d): %s\n", what, (int)s, nflash_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s PACK [MEMORY_BUDGET_MIB]\n", argv[0]);
        return 2;
    }
    printf("libnflash %s\n", nflash_version());
    nflash_options opts;
    nflash_options_default(&opts);
    if (argc > 2) opts.memory_budget_bytes = strtoull(argv[2], NULL, 10) << 20;
    opts.ctx = 1024;
    nflash_model *model = NULL;
    nflash_status s = nflash_open(argv[1], &opts, &model);
    if (s != NFLASH_STATUS_OK) return fail("nflash_open", s);

    /* Errors are codes plus a message, never a crash. */
    nflash_model *none = NULL;
    s = nflash_open("/nonexistent.nflash", NULL, &none);
    if (s == NFLASH_STATUS_OK || strlen(nflash_last_error()) == 0) return fail("opening a missing file should fail", s);
    printf("a missing pack: status %d, \"%s\"\n", (int)s, nflash_last_error());

    nflash_params params;
    nflash_params_default(model, &params);
    params.temperature = 0; /* greedy */
    params.max_tokens = 48;

    /* A long system prompt, as apps have: later turns take its keys and
       values from the KV cache (reused by whole prefill passes, 256 tokens
       for SmolLM2), so it is computed once. */
    static const char system[] =
        "You are a helpful assistant on a phone. Answer in one short sentence. "
        "Be accurate: name cities, countries and dates exactly as an atlas or an encyclopedia would. "
        "Do not greet the user, do not repeat the question, and do not add advice nobody asked for. "
        "If you do not know, say so plainly. Prefer the common English name of a place. "
        "Keep numbers as digits. Never invent sources. Never ask a question back. "
        "The user reads on a small screen while walking, so every word must earn its place. "
        "Facts about capitals: Paris is the capital of France, Berlin of Germany, Madrid of Spain, "
        "Rome of Italy, Lisbon of Portugal, Vienna of Austria, Warsaw of Poland, Prague of Czechia, "
        "Budapest of Hungary, Athens of Greece, Dublin of Ireland, Oslo of Norway, Stockholm of Sweden, "
        "Helsinki of Finland, Copenhagen of Denmark, Brussels of Belgium, Amsterdam of the Netherlands, "
        "Bern of Switzerland, Ottawa of Canada, Canberra of Australia, Wellington of New Zealand, "
        "Tokyo of Japan, Seoul of South Korea, Beijing of China, New Delhi of India, Cairo of Egypt, "
        "Nairobi of Kenya, Brasilia of Brazil, Buenos Aires of Argentina, Lima of Peru, "
        "Santiago of Chile, Bogota of Colombia, Mexico City of Mexico and Washington of the United States.";
    struct reply first = {0};
    nflash_message q1[] = {{"system", system}, {"user", "What is the capital of France?"}};
    s = nflash_chat(model, q1, 2, &params, on_token, &first);
    printf("\n");
    if (s != NFLASH_STATUS_OK) return fail("nflash_chat", s);
    nflash_stats_t st;
    nflash_stats(model, &st);
    printf("[%u prompt tokens, %u generated, %.1f tokens/s decode, peak RSS %.1f MiB, budget %.1f MiB]\n",
           st.prompt_tokens, st.generated_tokens, st.decode_tokens_per_s, st.peak_rss_bytes / 1048576.0,
           st.memory_budget_bytes / 1048576.0);
    if (!strstr(first.text, "Paris")) return fail("the answer should name Paris", s);
    if (opts.memory_budget_bytes && st.peak_rss_bytes > st.memory_budget_bytes) return fail("memory over budget", s);

    /* The second turn extends the first: its prefix comes from the KV cache. */
    struct reply second = {0};
    nflash_message q2[] = {{"system", system},
                           {"user", "What is the capital of France?"},
                           {"assistant", first.text},
                           {"user", "And of Germany?"}};
    s = nflash_chat(model, q2, 4, &params, on_token, &second);
    printf("\n");
    if (s != NFLASH_STATUS_OK) return fail("nflash_chat (second turn)", s);
    nflash_stats(model, &st);
    printf("[second turn: %u of %u prompt tokens reused]\n", st.reused_tokens, st.prompt_tokens);
    if (st.reused_tokens == 0) return fail("the second turn should reuse the first's KV cache", s);

    /* Cancel from another thread: the call returns CANCELLED early. */
    struct reply third = {0};
    struct canceller c = {model, &third};
    pthread_t t;
    pthread_create(&t, NULL, cancel_soon, &c);
    params.max_tokens = 400;
    s = nflash_complete(model, "Once upon a time", &params, on_token, &third);
    pthread_join(t, NULL);
    printf("\n");
    nflash_stats(model, &st);
    printf("[cancelled after %u tokens: status %d]\n", st.generated_tokens, (int)s);
    if (s != NFLASH_STATUS_CANCELLED || st.generated_tokens >= 400) return fail("cancel", s);

    /* A bad argument is a status and a message. */
    params.top_p = 2;
    s = nflash_complete(model, "x", &params, NULL, NULL);
    if (s != NFLASH_STATUS_INVALID_ARGUMENT) return fail("top_p 2 should be refused", s);
    printf("top_p 2: status %d, \"%s\"\n", (int)s, nflash_last_error());
    nflash_free(model);
    printf("ok\n");
    return 0;
}
