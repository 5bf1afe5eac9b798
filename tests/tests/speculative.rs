//! Speculative decoding (issue 47): a draft's guesses checked by verify
//! passes give the tokens, and leave the KV cache, that plain decoding
//! gives, greedy and seeded sampling alike, on dense, sparse and
//! mixture-of-experts packs, with the FFN in memory or on flash.

use std::path::{Path, PathBuf};

use nflash_format::Pack;
use nflash_runtime::draft::{DraftCache, DraftKind, DraftModel, SpecOptions};
use std::ops::ControlFlow;

use nflash_runtime::generate::{generate_until, generate_with_draft, GenStats, GenerateOptions, PackDraft};
use nflash_runtime::sampler::{Sampler, SamplerConfig};
use nflash_runtime::Engine;
use nflash_tests::{placements, run, tiny_words, write_tiny_checkpoint, TinySpec, QUICK_CALIB};

/// `prep convert` of a tiny checkpoint of `spec` into `dir/name`, with
/// 1 KiB neuron clusters (many per layer) and `extra` flags.
fn pack(dir: &Path, spec: &TinySpec, name: &str, quant: &str, extra: &[&str]) -> PathBuf {
    let ckpt = dir.join(format!("{name}-ckpt"));
    write_tiny_checkpoint(&ckpt, spec);
    let out = dir.join(name);
    let mut args = vec!["convert", "--model", ckpt.to_str().unwrap(), "--out", out.to_str().unwrap(), "--quant", quant];
    args.extend_from_slice(&["--cluster-bytes", "1KiB"]);
    args.extend_from_slice(extra);
    let o = run("prep", &args);
    assert!(o.status.success(), "prep convert failed: {}", String::from_utf8_lossy(&o.stderr));
    out
}

/// Prompts (token ids valid for vocabularies of 96 or more): repeated
/// phrases, which lookup drafts from, and words without repeats.
fn prompts() -> Vec<Vec<u32>> {
    let phrase: Vec<u32> = vec![11, 40, 7, 23, 5, 61];
    let mut repeated = phrase.clone();
    repeated.extend([3, 9]);
    repeated.extend(&phrase);
    repeated.extend(&phrase[..3]);
    vec![
        repeated,
        (0..20).map(|i| 3 + (i * 13) % 90).collect(),
        vec![17, 17, 17, 17, 17],
        (0..9).map(|i| 4 + (i * 7) % 50).collect(),
    ]
}

/// Generates from `prompt` with `engine` under `draft`; the tokens, the
/// KV cache's length at the end and the counters.
fn gen(engine: &Engine, prompt: &[u32], temperature: f32, draft: DraftKind, k: usize) -> (Vec<u32>, usize, GenStats) {
    let opts = GenerateOptions {
        max_tokens: 40,
        stop_ids: engine.stop_ids.clone(),
        ignore_eos: temperature > 0.0,
        speculate: SpecOptions { draft, max_draft: k },
        ..Default::default()
    };
    gen_with(engine, prompt, temperature, &opts, |_| ControlFlow::Continue(()))
}

/// [`gen`] with the caller's options and text callback (seed 7, a
/// 96-token KV cache).
fn gen_with(
    engine: &Engine,
    prompt: &[u32],
    temperature: f32,
    opts: &GenerateOptions,
    on_text: impl FnMut(&str) -> ControlFlow<()>,
) -> (Vec<u32>, usize, GenStats) {
    let mut kv = engine.model.new_kv_cache(96);
    let mut sampler = Sampler::new(SamplerConfig { temperature, top_k: 0, top_p: 1.0, seed: 7 });
    let (ids, st) =
        generate_until(&engine.model, &mut kv, &engine.tokenizer, prompt, &mut sampler, opts, on_text).unwrap();
    (ids, kv.len(), st)
}

/// The drafts checked: every kind but `off`.
const DRAFTS: [DraftKind; 3] = [DraftKind::Lookup, DraftKind::SelfDraft, DraftKind::Auto];

/// Every placement of `path`'s FFN (in memory, and partly on flash, where a
/// self-draft sees only part of the neurons), greedy and sampled (at
/// temperatures high enough that tiny models' samples vary), each draft
/// with K = 1, 3 and 6:
/// the speculative tokens and KV-cache length equal plain decoding's; the
/// drafts were really checked (some accepted, some rejected) overall.
/// With `partial_differs`, greedy self-drafts from part of the FFN must
/// miss some tokens (a tiny Gemma 3's embeddings, scaled by √hidden,
/// outweigh its FFN: here its greedy self-drafts were all kept). First,
/// [`check_verify_bits`].
fn check_same_tokens(path: &Path, partial_differs: bool) {
    check_verify_bits(path);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(|| {
        let pack = Pack::open_resident(path).unwrap();
        let (mut accepted, mut rejected) = (0, 0);
        for (pi, (name, cfg)) in placements(path).into_iter().enumerate() {
            let engine = Engine::load_with(&pack, &cfg).unwrap();
            // Greedy self-drafts: (drafted, accepted) in this placement.
            let mut self_greedy = (0, 0);
            for (i, prompt) in prompts().iter().enumerate() {
                for temperature in [0.0, 1.5, 6.0] {
                    let plain = gen(&engine, prompt, temperature, DraftKind::Off, 4);
                    assert_eq!(plain.2.draft_tokens, 0);
                    for (draft, k) in DRAFTS.iter().flat_map(|&d| [1, 3, 6].map(|k| (d, k))) {
                        let spec = gen(&engine, prompt, temperature, draft, k);
                        let what = format!("{name}, prompt {i}, temperature {temperature}, {draft:?} K {k}");
                        assert_eq!(spec.0, plain.0, "{what}: tokens differ");
                        assert_eq!(spec.1, plain.1, "{what}: KV cache lengths differ");
                        assert_eq!(spec.2.decode_tokens, plain.2.decode_tokens, "{what}: decode tokens");
                        assert!(spec.2.accepted_tokens <= spec.2.draft_tokens);
                        accepted += spec.2.accepted_tokens;
                        rejected += spec.2.draft_tokens - spec.2.accepted_tokens;
                        if draft == DraftKind::SelfDraft && temperature == 0.0 {
                            (self_greedy.0, self_greedy.1) =
                                (self_greedy.0 + spec.2.draft_tokens, self_greedy.1 + spec.2.accepted_tokens);
                        }
                    }
                }
            }
            // The self-draft is the model on its resident neurons: the
            // whole model in memory (every greedy guess kept), a part of it
            // with nothing hot and a minimal cold region (guesses rejected).
            let (drafted, kept) = self_greedy;
            match pi {
                0 => assert!(drafted > 0 && kept == drafted, "{name}: self-draft kept {kept} of {drafted}"),
                1 | 2 if partial_differs => assert!(kept < drafted, "{name}: self-draft kept {kept} of {drafted}"),
                _ => {}
            }
        }
        assert!(accepted > 0 && rejected > 0, "drafts never accepted ({accepted}) or never rejected ({rejected})");
    });
}

/// A verify pass gives decode's bits: its final hidden states (from which
/// the logits follow) equal, bit for bit, those of decoding the same tokens
/// one pass each, under every placement and 1 to 3 threads, for passes of
/// 2, 5 and 17 tokens (K = 1, 4 and 16) after each prompt; and decoding on
/// after the KV cache is rolled back into the pass gives decode's bits too.
fn check_verify_bits(path: &Path) {
    let pack = Pack::open_resident(path).unwrap();
    for (name, cfg) in placements(path) {
        for threads in 1..=3 {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let engine = Engine::load_with(&pack, &cfg).unwrap();
                let model = &engine.model;
                let h = model.cfg.hidden_size as usize;
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                for (i, prompt) in prompts().iter().enumerate() {
                    for n in [2, 5, 17] {
                        let tokens: Vec<u32> = (0..n).map(|j| ((5 + 7 * j + i) % 90 + 3) as u32).collect();
                        let mut kv = model.new_kv_cache(96);
                        model.forward(&mut kv, prompt).unwrap();
                        let mut decoded = Vec::new();
                        for &t in &tokens {
                            decoded.extend(bits(&model.forward(&mut kv, &[t]).unwrap()));
                        }
                        let mut kv = model.new_kv_cache(96);
                        model.forward(&mut kv, prompt).unwrap();
                        let verified = bits(&model.verify(&mut kv, &tokens).unwrap());
                        let what = format!("{name}, {threads} threads, prompt {i}, {n} tokens");
                        for t in 0..n {
                            assert!(
                                verified[t * h..(t + 1) * h] == decoded[t * h..(t + 1) * h],
                                "{what}: token {t}'s hidden state differs from decode's"
                            );
                        }
                        kv.truncate(prompt.len() + 1);
                        let next = bits(&model.forward(&mut kv, &[tokens[1]]).unwrap());
                        assert!(next[..] == decoded[h..2 * h], "{what}: decode after a rollback differs");
                    }
                }
            });
        }
    }
}

#[test]
fn speculation_gives_plain_decodings_tokens_dense() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec { inter: 256, layers: 3, vocab: 96, ..TinySpec::default() };
    check_same_tokens(&pack(dir.path(), &spec, "dense.nflash", "q8_0", &[]), true);
}

#[test]
fn speculation_gives_plain_decodings_tokens_sparse() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec { inter: 256, layers: 3, vocab: 96, ..TinySpec::default() };
    let calib = dir.path().join("calib.txt");
    std::fs::write(&calib, tiny_words(1200, spec.vocab, 7)).unwrap();
    let mut flags = vec!["--calib", calib.to_str().unwrap(), "--sparsity", "0.5"];
    flags.extend(QUICK_CALIB);
    let p = pack(dir.path(), &spec, "sparse.nflash", "q4_0", &flags);
    assert!(Pack::open_resident(&p).unwrap().manifest().sparse.is_some(), "the pack is not sparse");
    check_same_tokens(&p, true);
}

/// The mixture of experts the MoE tests convert: a tiny Mixtral.
fn tiny_mixtral() -> TinySpec {
    TinySpec { arch: "MixtralForCausalLM", tied: false, rope_theta: 1e6, seed: 31, vocab: 96, ..TinySpec::default() }
}

#[test]
fn speculation_gives_plain_decodings_tokens_moe() {
    let dir = tempfile::tempdir().unwrap();
    check_same_tokens(&pack(dir.path(), &tiny_mixtral(), "moe.nflash", "q4_0", &[]), true);
}

/// A mixture of experts' verify pass routes every token first, then reads
/// each routed expert's clusters once for the pass: the union of the
/// tokens' clusters is counted (below the sum of each token's, since the
/// tokens share experts), and with nothing hot and a minimal cold region the
/// pass reads no more clusters from flash than that union (token by token,
/// the later tokens re-read what the earlier ones' experts evicted).
#[test]
fn a_moe_verify_pass_reads_each_routed_experts_clusters_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = pack(dir.path(), &tiny_mixtral(), "moe.nflash", "q4_0", &[]);
    let pack = Pack::open_resident(&path).unwrap();
    let (name, cfg) = placements(&path).remove(2);
    let engine = Engine::load_with(&pack, &cfg).unwrap();
    let model = &engine.model;
    for (i, prompt) in prompts().iter().enumerate() {
        let mut kv = model.new_kv_cache(96);
        model.forward(&mut kv, prompt).unwrap();
        model.reset_counters();
        let before = model.cache_stats();
        let tokens: Vec<u32> = (0..9).map(|j| ((11 + 5 * j + i) % 90 + 3) as u32).collect();
        model.verify(&mut kv, &tokens).unwrap();
        let read = model.cache_stats().since(&before);
        let counts = model.counters().0;
        let needed: u64 = counts.iter().map(|c| c.verify_needed).sum();
        let union: u64 = counts.iter().map(|c| c.verify_union).sum();
        let what = format!("{name}, prompt {i}: needed {needed}, union {union}, read {read:?}");
        assert!(union > 0 && union < needed, "{what}");
        assert!(read.misses > 0 && read.misses <= union, "{what}");
    }
}

/// A generation stopped by its caller in the middle of a verify pass's
/// accepted tokens counts only the tokens it used as decoded: the same
/// `decode_tokens` as plain decoding stopped at the same piece.
#[test]
fn a_stop_inside_a_verify_pass_counts_only_the_tokens_used() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec { inter: 256, layers: 3, vocab: 96, ..TinySpec::default() };
    let path = pack(dir.path(), &spec, "dense.nflash", "q8_0", &[]);
    let pack = Pack::open_resident(&path).unwrap();
    let engine = Engine::load_with(&pack, &placements(&path)[0].1).unwrap();
    let prompt = &prompts()[1];
    let run = |draft: DraftKind| {
        let opts = GenerateOptions {
            max_tokens: 40,
            ignore_eos: true,
            speculate: SpecOptions { draft, max_draft: 16 },
            ..Default::default()
        };
        let mut pieces = 0;
        gen_with(&engine, prompt, 0.0, &opts, |_| {
            pieces += 1;
            if pieces == 5 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
    };
    // In memory a self-draft is the model: every guess is kept, 16 a pass.
    let (plain, spec) = (run(DraftKind::Off), run(DraftKind::SelfDraft));
    assert_eq!(spec.0, plain.0);
    assert_eq!(spec.1, plain.1);
    assert!(spec.2.accepted_tokens > spec.2.decode_tokens - spec.2.decode_steps, "no pass was cut short: {:?}", spec.2);
    assert_eq!(spec.2.decode_tokens, plain.2.decode_tokens);
}

/// Generates from `prompt` with `engine` and the draft model `draft`
/// (`kind` [`DraftKind::Pack`] or [`DraftKind::Auto`], K = `k`; seed 7, a
/// 96-token KV cache); the tokens, the KV cache's length at the end and
/// the counters.
fn gen_drafted(
    engine: &Engine,
    draft: &DraftModel,
    kind: DraftKind,
    prompt: &[u32],
    temperature: f32,
    k: usize,
) -> (Vec<u32>, usize, GenStats) {
    let opts = GenerateOptions {
        max_tokens: 40,
        stop_ids: engine.stop_ids.clone(),
        ignore_eos: temperature > 0.0,
        speculate: SpecOptions { draft: kind, max_draft: k },
        ..Default::default()
    };
    let mut kv = engine.model.new_kv_cache(96);
    let mut cache = DraftCache::new(&draft.model, 96).unwrap();
    let pack = PackDraft { draft, cache: &mut cache, history: &[] };
    let mut sampler = Sampler::new(SamplerConfig { temperature, top_k: 0, top_p: 1.0, seed: 7 });
    let (ids, st) =
        generate_with_draft(&engine.model, &mut kv, &engine.tokenizer, prompt, &mut sampler, &opts, Some(pack), |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
    (ids, kv.len(), st)
}

/// A draft pack's guesses give plain decoding's tokens and KV cache under
/// every placement of `target`, greedy and sampled, K = 1, 3 and 6, with
/// each of `drafts` (the target itself, in memory: every greedy guess
/// kept; another model with the same tokenizer: some kept, some not);
/// `auto` with the draft gives them too.
fn check_draft_pack(target: &Path, drafts: &[&Path]) {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(|| {
        let pack = Pack::open_resident(target).unwrap();
        let draft_packs: Vec<Pack> = drafts.iter().map(|d| Pack::open_resident(d).unwrap()).collect();
        for (name, cfg) in placements(target) {
            let mut engine = Engine::load_with(&pack, &cfg).unwrap();
            let mut draft_models = Vec::new();
            for d in &draft_packs {
                engine.attach_draft(&pack, d).unwrap();
                draft_models.push(engine.draft.take().unwrap());
            }
            for (di, draft) in draft_models.iter().enumerate() {
                let (mut drafted, mut kept, mut greedy) = (0, 0, (0, 0));
                for (i, prompt) in prompts().iter().enumerate() {
                    for temperature in [0.0, 1.5] {
                        let plain = gen(&engine, prompt, temperature, DraftKind::Off, 4);
                        let auto = gen_drafted(&engine, draft, DraftKind::Auto, prompt, temperature, 4);
                        assert_eq!(auto.0, plain.0, "{name}, draft {di}, prompt {i}, auto: tokens differ");
                        assert_eq!(auto.2.draft_source, DraftKind::Pack);
                        for k in [1, 3, 6] {
                            let spec = gen_drafted(&engine, draft, DraftKind::Pack, prompt, temperature, k);
                            let what = format!("{name}, draft {di}, prompt {i}, temperature {temperature}, K {k}");
                            assert_eq!(spec.0, plain.0, "{what}: tokens differ");
                            assert_eq!(spec.1, plain.1, "{what}: KV cache lengths differ");
                            assert_eq!(spec.2.decode_tokens, plain.2.decode_tokens, "{what}: decode tokens");
                            assert_eq!(spec.2.draft, DraftKind::Pack);
                            (drafted, kept) = (drafted + spec.2.draft_tokens, kept + spec.2.accepted_tokens);
                            if temperature == 0.0 {
                                greedy = (greedy.0 + spec.2.draft_tokens, greedy.1 + spec.2.accepted_tokens);
                            }
                        }
                    }
                }
                let what = format!("{name}, draft {di}: {kept} of {drafted} kept, greedy {greedy:?}");
                assert!(drafted > 0 && kept > 0, "{what}");
                if drafts[di] == target {
                    // The target itself drafts exactly its greedy tokens
                    // wherever its FFN is whole in memory.
                    if name.starts_with("whole") {
                        assert_eq!(greedy.0, greedy.1, "{what}");
                    }
                } else {
                    assert!(kept < drafted, "{what}");
                }
            }
        }
    });
}

/// A draft pack (issue 47): the target itself and a smaller model with the
/// same tokenizer, for dense, sparse and mixture-of-experts targets.
#[test]
fn a_draft_pack_gives_plain_decodings_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = TinySpec { inter: 256, layers: 3, vocab: 96, ..TinySpec::default() };
    let small =
        pack(d, &TinySpec { inter: 64, layers: 1, vocab: 96, seed: 5, ..TinySpec::default() }, "small", "q8_0", &[]);
    let dense = pack(d, &spec, "dense.nflash", "q8_0", &[]);
    check_draft_cache(&dense);
    check_draft_pack(&dense, &[&dense, &small]);
    let calib = d.join("calib.txt");
    std::fs::write(&calib, tiny_words(1200, spec.vocab, 7)).unwrap();
    let mut flags = vec!["--calib", calib.to_str().unwrap(), "--sparsity", "0.5"];
    flags.extend(QUICK_CALIB);
    let sparse = pack(d, &spec, "sparse.nflash", "q4_0", &flags);
    check_draft_pack(&sparse, &[&sparse, &small]);
    let moe = pack(d, &tiny_mixtral(), "moe.nflash", "q4_0", &[]);
    check_draft_pack(&moe, &[&moe, &small]);
}

/// A model whose vocabulary is padded past its tokenizer's (128 embedding
/// rows, 96 tokens) samples ids the draft (96 rows, the same tokenizer)
/// has no embedding for: the draft skips its guesses after them, and the
/// text is still plain decoding's (it was a failed generation before).
#[test]
fn a_draft_with_fewer_embedding_rows_skips_what_it_cannot_read() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ckpt = d.join("padded-ckpt");
    write_tiny_checkpoint(&ckpt, &TinySpec { inter: 256, layers: 2, vocab: 128, seed: 9, ..TinySpec::default() });
    std::fs::write(ckpt.join("tokenizer.json"), serde_json::to_vec(&nflash_tests::tiny_tokenizer_json(96)).unwrap())
        .unwrap();
    let target = d.join("padded.nflash");
    let o = run(
        "prep",
        &["convert", "--model", ckpt.to_str().unwrap(), "--out", target.to_str().unwrap(), "--quant", "q8_0"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let draft = pack(d, &TinySpec { inter: 64, layers: 1, vocab: 96, ..TinySpec::default() }, "draft", "q8_0", &[]);
    let (tp, dp) = (Pack::open_resident(&target).unwrap(), Pack::open_resident(&draft).unwrap());
    let mut engine = Engine::load(&tp).unwrap();
    engine.attach_draft(&tp, &dp).unwrap();
    let draft_model = engine.draft.as_ref().unwrap();
    let mut past = false;
    for prompt in prompts() {
        for temperature in [0.0, 1.5] {
            let plain = gen(&engine, &prompt, temperature, DraftKind::Off, 4);
            let spec = gen_drafted(&engine, draft_model, DraftKind::Pack, &prompt, temperature, 4);
            assert_eq!(spec.0, plain.0, "temperature {temperature}");
            past |= plain.0.iter().any(|&t| t >= 96);
        }
    }
    assert!(past, "the model never sampled an id past the tokenizer's");
    // Directly: no guess after such an id, and no error.
    let mut cache = DraftCache::new(&draft_model.model, 96).unwrap();
    let mut guesses = vec![1];
    cache.propose(&draft_model.model, &[11, 40, 100, 7], 4, &[], 128, &mut guesses).unwrap();
    assert!(guesses.is_empty() && cache.len() == 2, "{guesses:?}, {} in the cache", cache.len());
    cache.propose(&draft_model.model, &[11, 40, 7], 4, &[], 128, &mut guesses).unwrap();
    assert_eq!(guesses.len(), 4);
}

/// Sliding-window layers in the draft (Gemma 3, window 5): its KV rings
/// roll back past rejected guesses (a tiny Gemma 3's greedy tokens follow
/// its embeddings, so it drafts for a Llama, whose tokens differ).
#[test]
fn a_sliding_window_draft_pack_gives_plain_decodings_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec { inter: 256, layers: 3, vocab: 96, ..TinySpec::default() };
    let target = pack(dir.path(), &spec, "dense.nflash", "q8_0", &[]);
    let draft = pack(dir.path(), &TinySpec { vocab: 96, ..TinySpec::gemma3(43) }, "gemma3.nflash", "q8_0", &[]);
    check_draft_pack(&target, &[&draft]);
    check_draft_cache(&draft);
}

/// A draft pack's KV cache, rolled back past rejected guesses and caught up
/// on the text that was kept, guesses what a fresh draft does: one that
/// prefills the prompt, then runs the text after it one token at a time,
/// as the draft's own catch-ups do (the same passes, so the same bits).
fn check_draft_cache(path: &Path) {
    let pack = Pack::open_resident(path).unwrap();
    let engine = Engine::load(&pack).unwrap();
    let model = &engine.model;
    for (pi, prompt) in prompts().iter().enumerate() {
        let mut cache = DraftCache::new(model, 96).unwrap();
        let mut text = prompt.clone();
        let (mut guesses, mut want) = (Vec::new(), Vec::new());
        for i in 0..12 {
            let k = 1 + i % 4;
            cache.propose(model, &text, k, &[], 96, &mut guesses).unwrap();
            let mut fresh = DraftCache::new(model, 96).unwrap();
            fresh.catch_up(model, &text[..prompt.len() - 1]).unwrap();
            for j in prompt.len()..text.len() {
                fresh.catch_up(model, &text[..j]).unwrap();
            }
            fresh.propose(model, &text, k, &[], 96, &mut want).unwrap();
            assert_eq!(guesses, want, "prompt {pi}, proposal {i}: {text:?}");
            assert_eq!(cache.restarts(), 0, "prompt {pi}, proposal {i}: the KV cache was run again from the start");
            assert!(!guesses.is_empty());
            // Keep some guesses (none, some, all in turn), then a token of the target's.
            let kept = i % (guesses.len() + 1);
            text.extend_from_slice(&guesses[..kept]);
            text.push((3 + (i * 13 + pi * 7) % 90) as u32);
        }
    }
}

/// Sliding-window layers (Gemma 3, window 5): their KV rings roll back
/// past drafts and rejected guesses.
#[test]
fn speculation_gives_plain_decodings_tokens_sliding_window() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec { vocab: 96, ..TinySpec::gemma3(41) };
    check_same_tokens(&pack(dir.path(), &spec, "gemma3.nflash", "q8_0", &[]), false);
}

/// Verify passes give decode's bits on every weight type: Q4_0, f16 and
/// f32 bundles (Q8_0 is the dense test's).
#[test]
fn verify_passes_give_decodes_bits_on_every_weight_type() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec { inter: 256, layers: 2, vocab: 96, ..TinySpec::default() };
    for quant in ["q4_0", "f16", "f32"] {
        check_verify_bits(&pack(dir.path(), &spec, &format!("{quant}.nflash"), quant, &[]));
    }
}

/// `nflash run --speculate-draft lookup` prints the text plain decoding
/// prints, and `--stats-json` reports the drafts: passes apart from tokens.
#[test]
fn nflash_run_speculates_with_the_same_text() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec { inter: 256, layers: 3, vocab: 96, ..TinySpec::default() };
    let p = pack(dir.path(), &spec, "dense.nflash", "q8_0", &[]);
    let words = tiny_words(30, spec.vocab, 3);
    let prompt = format!("{words} {words}");
    let go = |draft: &str| {
        let json = dir.path().join(format!("{draft}.json"));
        let o = run(
            "nflash",
            &[
                "run",
                "--model",
                p.to_str().unwrap(),
                "--prompt",
                &prompt,
                "--raw",
                "--temperature",
                "0",
                "--ignore-eos",
                "--max-tokens",
                "48",
                "--speculate-draft",
                draft,
                "--stats-json",
                json.to_str().unwrap(),
            ],
        );
        assert!(o.status.success(), "{draft}: {}", String::from_utf8_lossy(&o.stderr));
        let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
        (String::from_utf8(o.stdout).unwrap(), j)
    };
    let (plain, pj) = go("off");
    let (spec_text, sj) = go("lookup");
    assert_eq!(spec_text, plain);
    assert_eq!(pj["draft_tokens"], 0);
    assert_eq!(pj["decode_passes"], pj["decode_tokens"]);
    assert_eq!(sj["speculate_draft"], "lookup");
    // A verify pass fetches the union of its tokens' clusters: no more than their sum.
    let union = sj["verify_cluster_union_per_pass"].as_f64().unwrap();
    let needed = sj["verify_clusters_needed_per_pass"].as_f64().unwrap();
    assert!(union > 0.0 && union <= needed, "union {union}, needed {needed}");
    assert!(pj["verify_cluster_union_per_pass"].is_null());
    for draft in ["self", "auto"] {
        let (text, j) = go(draft);
        assert_eq!(text, plain, "{draft}");
        assert_eq!(j["speculate_draft"], draft);
        assert_eq!(j["decode_tokens"], pj["decode_tokens"], "{draft}");
    }
    let (drafted, accepted) = (sj["draft_tokens"].as_u64().unwrap(), sj["accepted_tokens"].as_u64().unwrap());
    assert!(drafted > 0 && accepted <= drafted, "{sj}");
    assert_eq!(sj["decode_tokens"], pj["decode_tokens"]);
    assert_eq!(
        sj["decode_passes"].as_u64().unwrap() + accepted,
        sj["decode_tokens"].as_u64().unwrap(),
        "each pass samples its accepted tokens and one more"
    );
    assert_eq!(sj["acceptance_by_draft"]["lookup"]["accepted_tokens"], accepted);
    // Out-of-range K is refused by the parser.
    let o = run("nflash", &["run", "--model", p.to_str().unwrap(), "--prompt", "a", "--draft-tokens", "0"]);
    assert!(!o.status.success());
    // A K that `off` leaves unused is noted, not refused (a sweep over drafts passes one K to all).
    for (draft, noted) in [("off", true), ("lookup", false)] {
        let a = ["run", "--model", p.to_str().unwrap(), "--prompt", "a", "--max-tokens", "2", "--draft-tokens", "3"];
        let o = run("nflash", &[&a[..], &["--speculate-draft", draft]].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{err}");
        assert_eq!(err.contains("--draft-tokens 3 is unused"), noted, "{draft}: {err}");
    }
}

/// `nflash run --draft PACK`: the draft pack's guesses (`auto` means pack
/// with a draft) give plain decoding's text; it is planned inside
/// --memory-budget and shown; a draft with another tokenizer, `pack`
/// without a draft and a draft with another kind are refused, saying why.
#[test]
fn nflash_run_drafts_with_a_draft_pack() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = TinySpec { inter: 256, layers: 3, vocab: 96, ..TinySpec::default() };
    let p = pack(d, &spec, "dense.nflash", "q8_0", &[]);
    let small =
        pack(d, &TinySpec { inter: 64, layers: 1, vocab: 96, seed: 5, ..TinySpec::default() }, "small", "q8_0", &[]);
    let other = pack(d, &TinySpec { inter: 64, layers: 1, vocab: 128, ..TinySpec::default() }, "other", "q8_0", &[]);
    let words = tiny_words(30, spec.vocab, 3);
    let go = |extra: &[&str]| {
        let json = d.join("stats.json");
        let mut args = vec!["run", "--model", p.to_str().unwrap(), "--prompt", &words, "--raw", "--temperature", "0"];
        args.extend([
            "--ignore-eos",
            "--max-tokens",
            "40",
            "--ctx",
            "128",
            "--stats",
            "--stats-json",
            json.to_str().unwrap(),
        ]);
        args.extend_from_slice(extra);
        let o = run("nflash", &args);
        let j = std::fs::read_to_string(&json).ok().map(|t| serde_json::from_str::<serde_json::Value>(&t).unwrap());
        let _ = std::fs::remove_file(&json);
        (o, j)
    };
    let (plain, pj) = go(&["--speculate-draft", "off"]);
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    // pack drafts, its guesses counted as pack's; auto, with the model in
    // memory, would never draft (a verify pass costs there what it saves),
    // so the draft is not even loaded, and the run says so.
    for (draft, kind) in [(&p, "pack"), (&small, "pack"), (&small, "auto")] {
        let (o, j) = go(&["--draft", draft.to_str().unwrap(), "--speculate-draft", kind]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{err}");
        assert_eq!(o.stdout, plain.stdout, "{kind}");
        let j = j.unwrap();
        assert_eq!(j["speculate_draft"], kind, "{j}");
        assert_eq!(j["decode_tokens"], pj.as_ref().unwrap()["decode_tokens"]);
        if kind == "pack" {
            assert!(j["acceptance_by_draft"]["pack"]["draft_tokens"].as_u64().unwrap() > 0, "{j}");
            assert!(err.contains("draft pack") && err.contains("MiB in memory"), "{err}");
        } else {
            assert_eq!(j["draft_tokens"], 0, "{j}");
            assert!(err.contains("is not loaded"), "{err}");
        }
    }
    assert!(go(&["--draft", p.to_str().unwrap(), "--speculate-draft", "pack"])
        .0
        .stderr
        .windows(9)
        .any(|w| w == b"own pack:"));
    // Inside a budget: the plan's fixed region holds the draft.
    let (o, _) = go(&["--draft", small.to_str().unwrap(), "--speculate-draft", "pack", "--memory-budget", "64MiB"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("inside the fixed region"), "{err}");
    assert_eq!(o.stdout, plain.stdout);
    // Refusals.
    let refused = |extra: &[&str], want: &str| {
        let (o, _) = go(extra);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{extra:?}: {err}");
    };
    refused(&["--draft", other.to_str().unwrap()], "another tokenizer");
    refused(&["--speculate-draft", "pack"], "needs a draft pack");
    refused(&["--draft", small.to_str().unwrap(), "--speculate-draft", "lookup"], "not lookup");
    refused(&["--draft", d.join("missing.nflash").to_str().unwrap()], "missing.nflash");
    // A FIFO (opening one blocks until a writer comes) or a device as the
    // draft or the model: refused before it is opened, naming what it is.
    let fifo = d.join("fifo.nflash");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    refused(&["--draft", fifo.to_str().unwrap(), "--speculate-draft", "pack"], "--draft: ");
    refused(&["--draft", "/dev/zero", "--speculate-draft", "pack"], "is a character device");
    let o = run("nflash", &["run", "--model", fifo.to_str().unwrap(), "--prompt", "a"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("is a FIFO"));
}
