//! Chat templates of released models (tests/data/chat_templates/) render as
//! Hugging Face's `apply_chat_template` renders them: the expected strings
//! are written out here, each derived by hand from the template. And the
//! Qwen3 thinking switch (`enable_thinking`) reaches the template from
//! `nflash run` (here), `nflash serve` (serve.rs) and libnflash
//! (tests/c/capi_test.c).

use std::path::Path;

use nflash_runtime::chat::{ChatTemplate, Message};
use nflash_tests::{convert, repo_root, run, write_tiny_checkpoint, TinySpec};
use serde_json::{json, Value};

fn template(file: &str) -> String {
    std::fs::read_to_string(repo_root().join("tests/data/chat_templates").join(file)).unwrap()
}

const QWEN3: &str = "Qwen-Qwen3-0.6B.jinja";

/// A system prompt, a first exchange whose reply carries its reasoning, and
/// a second question.
fn conversation() -> Vec<Message> {
    vec![
        Message::new("system", "You are terse."),
        Message::new("user", "Hi"),
        Message::new("assistant", "<think>\nplan\n</think>\n\nHello!"),
        Message::new("user", "2+2?"),
    ]
}

/// Qwen3: the system turn first; the earlier reply without its reasoning
/// (it comes before the last user query, `ns.last_query_index`); the
/// assistant turn opened, with an empty `<think>` section exactly when
/// `enable_thinking` is false.
#[test]
fn qwen3_template_renders_as_transformers_with_the_thinking_switch() {
    let t = ChatTemplate::new(&template(QWEN3), None, Some("<|im_end|>")).unwrap();
    let base = "<|im_start|>system\nYou are terse.<|im_end|>\n\
                <|im_start|>user\nHi<|im_end|>\n\
                <|im_start|>assistant\nHello!<|im_end|>\n\
                <|im_start|>user\n2+2?<|im_end|>\n\
                <|im_start|>assistant\n";
    let msgs = conversation();
    assert_eq!(t.render(&msgs).unwrap(), base);
    assert_eq!(t.render_with(&msgs, Some(true)).unwrap(), base);
    assert_eq!(t.render_with(&msgs, Some(false)).unwrap(), format!("{base}<think>\n\n</think>\n\n"));
    // The reply after the last query keeps its reasoning, re-wrapped.
    let mut msgs = msgs;
    msgs.pop();
    let want = "<|im_start|>system\nYou are terse.<|im_end|>\n\
                <|im_start|>user\nHi<|im_end|>\n\
                <|im_start|>assistant\n<think>\nplan\n</think>\n\nHello!<|im_end|>\n\
                <|im_start|>assistant\n";
    assert_eq!(t.render(&msgs).unwrap(), want);
}

/// Phi-3.5-mini: `<|system|>`, `<|user|>`, `<|assistant|>` turns ended by
/// `<|end|>` and a newline.
#[test]
fn phi3_template_renders_as_transformers() {
    let t = ChatTemplate::new(&template("microsoft-Phi-3.5-mini-instruct.jinja"), Some("<s>"), Some("<|endoftext|>"))
        .unwrap();
    let msgs = [Message::new("system", "Be brief."), Message::new("user", "Hi"), Message::new("assistant", "Hello.")];
    assert_eq!(
        t.render(&msgs).unwrap(),
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n<|assistant|>\n"
    );
}

/// Gemma 3: `<bos>`, then `<start_of_turn>user` / `model` turns ended by
/// `<end_of_turn>` and a newline; the system prompt has no turn of its
/// own but opens the first user turn, followed by a blank line; content is
/// trimmed; the assistant role is called `model`.
#[test]
fn gemma3_template_renders_as_transformers() {
    let t = ChatTemplate::new(&template("google-gemma-3-4b-it.jinja"), Some("<bos>"), Some("<eos>")).unwrap();
    let msgs = [
        Message::new("system", "Be brief."),
        Message::new("user", " Hi \n"),
        Message::new("assistant", "Hello."),
        Message::new("user", "2+2?"),
    ];
    assert_eq!(
        t.render(&msgs).unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
         <start_of_turn>model\nHello.<end_of_turn>\n\
         <start_of_turn>user\n2+2?<end_of_turn>\n\
         <start_of_turn>model\n"
    );
    // Without a system prompt the first user turn has no prefix.
    assert_eq!(t.render(&msgs[1..2]).unwrap(), "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n");
}

/// Hugging Face compiles templates with `trim_blocks` and `lstrip_blocks`:
/// the newline after a block tag and the indentation before one vanish.
#[test]
fn templates_render_with_the_whitespace_settings_of_transformers() {
    let src =
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n  [{{ m.content }}]\n    {% endif %}\n{% endfor %}";
    let t = ChatTemplate::new(src, None, None).unwrap();
    let msgs = [Message::new("user", "a"), Message::new("assistant", "b"), Message::new("user", "c")];
    assert_eq!(t.render(&msgs).unwrap(), "  [a]\n  [c]\n");
}

/// A tiny Qwen3 pack whose tokenizer_config.json holds Qwen3's template.
pub fn tiny_qwen3_pack_with_its_template(tmp: &Path) -> std::path::PathBuf {
    let dir = tmp.join("ckpt");
    write_tiny_checkpoint(&dir, &TinySpec { arch: "Qwen3ForCausalLM", ..Default::default() });
    let tc = dir.join("tokenizer_config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&tc).unwrap()).unwrap();
    cfg["chat_template"] = json!(template(QWEN3));
    std::fs::write(&tc, cfg.to_string()).unwrap();
    let pack = tmp.join("qwen3.nflash");
    convert(&dir, &pack, "q8_0");
    pack
}

/// `nflash run --enable-thinking false` renders the empty `<think>`
/// section (more prompt tokens); `true` is the template's default.
#[test]
fn nflash_run_passes_enable_thinking_to_the_template() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_qwen3_pack_with_its_template(tmp.path());
    let prompt_tokens = |extra: &[&str]| -> u64 {
        let j = tmp.path().join("stats.json");
        let mut args = vec!["run", "--model", pack.to_str().unwrap(), "--chat", "--prompt", "w3 w4", "--max-tokens"];
        args.extend(["1", "--temperature", "0", "--stats-json", j.to_str().unwrap()]);
        args.extend(extra);
        let o = run("nflash", &args);
        assert!(o.status.success(), "nflash run {extra:?}: {}", String::from_utf8_lossy(&o.stderr));
        let v: Value = serde_json::from_slice(&std::fs::read(&j).unwrap()).unwrap();
        v["prompt_tokens"].as_u64().unwrap()
    };
    let default = prompt_tokens(&[]);
    assert_eq!(prompt_tokens(&["--enable-thinking", "true"]), default);
    assert!(prompt_tokens(&["--enable-thinking", "false"]) > default);
    let o = run(
        "nflash",
        &["run", "--model", pack.to_str().unwrap(), "--chat", "--prompt", "a", "--enable-thinking", "no"],
    );
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--enable-thinking"));
}
