//! Minimal use of the nflash runtime as a library: open a pack, render a chat
//! prompt, and generate greedily.
//!
//! ```text
//! cargo run --release --example generate -- models/smollm2-q4_0.nflash "What is the capital of France?"
//! ```

use nflash_runtime::chat::Message;
use nflash_runtime::generate::{generate, GenerateOptions};
use nflash_runtime::sampler::{Sampler, SamplerConfig};
use nflash_runtime::Engine;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(path), Some(question)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: generate PACK.nflash QUESTION");
    };
    let pack = nflash_format::Pack::open(&path)?;
    let engine = Engine::load(&pack)?;
    let template = engine.template.as_ref().ok_or_else(|| anyhow::anyhow!("pack has no chat template"))?;
    let prompt = template.render(&[Message::new("user", &question)])?;
    let ids = engine.tokenizer.encode(&prompt, false)?;
    let mut kv = engine.model.new_kv_cache(1024);
    let mut sampler = Sampler::new(SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 });
    let opts = GenerateOptions { max_tokens: 64, stop_ids: engine.stop_ids.clone(), ..Default::default() };
    let (_, stats) =
        generate(&engine.model, &mut kv, &engine.tokenizer, &ids, &mut sampler, &opts, |piece| print!("{piece}"))?;
    println!("\n[{:.1} tokens/s decode]", stats.decode_tokens_per_s());
    Ok(())
}
