//! Everything `nflash` loads from a pack: model views, tokenizer, chat template, stop set.

use nflash_format::Pack;
use nflash_plan::CacheConfig;

use crate::chat::{ChatOptions, ChatTemplate, ContentTokens, Message};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::offload::NeuronCache;
use crate::tokenizer::Tokenizer;

/// A loaded pack, ready to generate.
pub struct Engine<'a> {
    /// The transformer.
    pub model: Model<'a>,
    /// The packed tokenizer.
    pub tokenizer: Tokenizer,
    /// The packed chat template, if the pack has one.
    pub template: Option<ChatTemplate>,
    /// Token ids that end generation (every EOS of the config).
    pub stop_ids: Vec<u32>,
    /// How a raw (non-chat) prompt gets its BOS token.
    raw_bos: RawBos,
    /// Sampling defaults stored in the pack (SPEC §4.9).
    pub generation: nflash_format::GenerationDefaults,
    /// A draft model for speculative decoding's [`crate::draft::DraftKind::Pack`]
    /// (`nflash run --draft`), all in memory; see [`Self::attach_draft`].
    pub draft: Option<crate::draft::DraftModel<'a>>,
}

/// How a raw prompt starts (SPEC §4.2 `add_bos_token`).
#[derive(Clone, Copy)]
enum RawBos {
    /// Packs before 3.2: the tokenizer's post-processor decides.
    PostProcessor,
    /// The pack's `add_bos_token` decides: this id first, or nothing.
    Prepend(Option<u32>),
}

impl<'a> Engine<'a> {
    /// Loads model views, tokenizer and template from `pack`, after checking
    /// the CRC32 of the tokenizer and resident segments.
    ///
    /// # Errors
    /// A checksum mismatch naming the segment, missing/misshaped tensors, a bad tokenizer or template, or a tokenizer
    /// with more tokens than embedding rows ([`Error::TokenOutOfRange`]).
    pub fn load(pack: &'a Pack) -> Result<Self> {
        Self::load_with(pack, &CacheConfig::all_hot(pack))
    }

    /// As [`Self::load`], with the FFN neuron clusters split between memory
    /// and flash as `cache` says.
    ///
    /// # Errors
    /// As [`Self::load`].
    pub fn load_with(pack: &'a Pack, cache: &CacheConfig) -> Result<Self> {
        Self::load_planned(pack, || Ok(cache.clone()))
    }

    /// As [`Self::load_with`], with the cache layout chosen by `plan` once
    /// the resident tensors and tokenizer are in memory, so that it can
    /// measure the process's footprint ([`crate::stats::rss_bytes`]).
    ///
    /// # Errors
    /// As [`Self::load`], and `plan`'s error.
    pub fn load_planned(pack: &'a Pack, plan: impl FnOnce() -> Result<CacheConfig>) -> Result<Self> {
        // The tokenizer and resident segments are read whole at start anyway,
        // so their checksums are always checked (cheap next to the read);
        // FFN segments are checked cluster by cluster as they are read (CRC-32C,
        // SPEC §4.10), or whole by `nflash run --verify full` / `prep verify`.
        for (i, s) in pack.manifest().segments.iter().enumerate() {
            if s.kind != nflash_format::SegmentKind::Ffn {
                pack.verify_segment(i as u32)?;
            }
        }
        let tokenizer = Tokenizer::from_json(&pack.tokenizer_json()?).map_err(|e| match e {
            Error::Tokenizer(m) => Error::Tokenizer(format!(
                "the pack's {m}; the pack may be corrupt (check it with `prep verify`), or convert it again"
            )),
            e => e,
        })?;
        let model = load_model(pack, &plan()?)?;
        let vocab = model.cfg.vocab_size;
        if tokenizer.vocab_size() as u64 > vocab {
            return Err(Error::TokenOutOfRange { id: tokenizer.vocab_size() as u32 - 1, vocab });
        }
        let info = &pack.manifest().tokenizer;
        let template = info
            .chat_template
            .as_deref()
            .map(|src| ChatTemplate::new(src, info.bos_token.as_deref(), info.eos_token.as_deref()))
            .transpose()?;
        let raw_bos = if pack.header().minor < 2 {
            RawBos::PostProcessor
        } else {
            RawBos::Prepend(model.cfg.bos_token_id.filter(|_| info.add_bos_token))
        };
        let generation = pack.metadata()?.generation.unwrap_or_default();
        Ok(Engine {
            stop_ids: model.cfg.eos_token_ids.clone(),
            model,
            tokenizer,
            template,
            raw_bos,
            generation,
            draft: None,
        })
    }

    /// Loads the pack `draft` all in memory ([`Engine::load`]) as this
    /// engine's draft model for [`crate::draft::DraftKind::Pack`] (and
    /// `auto`); its KV cache and counters are its own, its KV type this
    /// model's. The two must share a tokenizer: every id names the same
    /// token. `pack`: this engine's pack, whose bytes against the draft's
    /// give [`crate::draft::DraftModel::cost`].
    ///
    /// # Errors
    /// As [`Engine::load`]; [`Error::Usage`] naming the first id whose token
    /// differs, and the draft's path.
    pub fn attach_draft(&mut self, pack: &Pack, draft: &'a Pack) -> Result<()> {
        let bytes = |p: &Pack| nflash_plan::layout::segment_bytes(p.manifest());
        let cost = bytes(draft) as f64 / bytes(pack).max(1) as f64;
        let mut loaded = Engine::load(draft)?;
        self.same_tokenizer(&loaded.tokenizer, draft)?;
        loaded.model.set_kv_type(self.model.kv_type());
        self.draft = Some(crate::draft::DraftModel { model: loaded.model, cost });
        Ok(())
    }

    /// Checks that the pack `draft` has this engine's tokenizer: every id
    /// names the same token (its tokenizer is read, not its weights).
    ///
    /// # Errors
    /// [`Error::Usage`] naming the first id whose token differs, and the
    /// draft's path; a damaged tokenizer segment's error.
    pub fn check_draft_tokenizer(&self, draft: &Pack) -> Result<()> {
        self.same_tokenizer(&Tokenizer::from_json(&draft.tokenizer_json()?)?, draft)
    }

    /// [`Self::check_draft_tokenizer`] with the draft's tokenizer `theirs`
    /// already parsed.
    fn same_tokenizer(&self, theirs: &Tokenizer, draft: &Pack) -> Result<()> {
        let Some((id, ours, theirs)) = self.tokenizer.vocab_difference(theirs) else { return Ok(()) };
        let show = |t: Option<String>| t.map_or_else(|| "missing".to_string(), |t| format!("{t:?}"));
        Err(Error::Usage(format!(
            "the draft pack {} has another tokenizer than the model: token id {id} is {} in the model and {} in the draft; a draft must share the model's tokenizer (the same model family, e.g. a smaller SmolLM2 for SmolLM2)",
            draft.path().display(),
            show(ours),
            show(theirs)
        )))
    }

    /// Token ids of a raw prompt (no chat template): the tokenizer's tokens,
    /// with the BOS token first when the pack's `add_bos_token` says so
    /// (from `tokenizer_config.json`; SPEC §4.2).
    ///
    /// # Errors
    /// [`Error::Tokenizer`].
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        encode_raw(&self.tokenizer, self.raw_bos, text, usize::MAX)
    }

    /// The BOS id a raw text starts with (the pack's `add_bos_token`,
    /// SPEC §4.2), which perplexity puts first in each window; `None` when
    /// it adds none, or for packs before 3.2 (their tokenizer decides).
    pub fn bos_of_text(&self) -> Option<u32> {
        match self.raw_bos {
            RawBos::Prepend(bos) => bos,
            RawBos::PostProcessor => None,
        }
    }

    /// As [`Prompter::encode_chat`].
    ///
    /// # Errors
    /// As [`Prompter::encode_chat`].
    pub fn encode_chat(&self, messages: &[Message], limit: usize) -> Result<Option<Vec<u32>>> {
        encode_chat(&self.tokenizer, self.template.as_ref(), messages, limit, ChatOptions::default())
    }

    /// As [`Prompter::encode_chat_with`].
    ///
    /// # Errors
    /// As [`Prompter::encode_chat`].
    pub fn encode_chat_with(&self, messages: &[Message], limit: usize, opts: ChatOptions) -> Result<Option<Vec<u32>>> {
        encode_chat(&self.tokenizer, self.template.as_ref(), messages, limit, opts)
    }

    /// As [`Prompter::encode_raw_at_most`].
    ///
    /// # Errors
    /// As [`Prompter::encode_raw_at_most`].
    pub fn encode_raw_at_most(&self, text: &str, limit: usize) -> Result<Vec<u32>> {
        encode_raw(&self.tokenizer, self.raw_bos, text, limit)
    }

    /// An owned copy of the tokenizer and chat template, to turn requests
    /// into token ids on another thread while this engine generates.
    pub fn prompter(&self) -> Prompter {
        Prompter { tokenizer: self.tokenizer.clone(), template: self.template.clone(), raw_bos: self.raw_bos }
    }
}

/// Turns prompts and chat messages into token ids as [`Engine`] does,
/// without the model ([`Engine::prompter`]).
#[derive(Clone)]
pub struct Prompter {
    /// The packed tokenizer.
    pub tokenizer: Tokenizer,
    /// The packed chat template, if the pack has one.
    pub template: Option<ChatTemplate>,
    raw_bos: RawBos,
}

impl Prompter {
    /// Token ids of `messages` rendered by the chat template with the
    /// assistant's turn opened (`add_generation_prompt`), at most `limit`
    /// of them ([`Tokenizer::encode_at_most`]), or `None` when the pack has
    /// no template. Special-token text in the messages' content stays
    /// plain text ([`ContentTokens::Text`]; see [`Self::encode_chat_with`]).
    ///
    /// # Errors
    /// [`Error::Template`] for a role not in [`crate::chat::ROLES`] or when
    /// the template refuses the messages, [`Error::PromptTooLong`],
    /// [`Error::Tokenizer`].
    pub fn encode_chat(&self, messages: &[Message], limit: usize) -> Result<Option<Vec<u32>>> {
        encode_chat(&self.tokenizer, self.template.as_ref(), messages, limit, ChatOptions::default())
    }

    /// As [`Self::encode_chat`], with [`ChatOptions`]: `content` says
    /// whether special-token text in the messages' content is plain text
    /// (the default, for untrusted content) or the control tokens it
    /// spells; `enable_thinking` is passed to the template.
    ///
    /// How content stays text: where no message spells a special token,
    /// the rendered conversation is tokenized as one text, as Hugging
    /// Face does. Otherwise each special token's text in the content is
    /// replaced by a private-use character found in no message and not in
    /// the template (one per special token), the template renders that,
    /// so whatever it does to the content (`trim`, `split('</think>')`, …)
    /// it does to the same characters, and
    /// [`Tokenizer::encode_escaped_at_most`] cuts the result at the
    /// special tokens it spells, which are the template's own, and
    /// tokenizes each piece between them with the escapes turned back
    /// into their text and read as plain characters. Only added tokens
    /// marked special are escaped: non-special added tokens (Qwen3's
    /// `<think>`) are words the template may act on and tokenize as in
    /// Hugging Face. A piece after a control token may then begin with a
    /// different token than in a whole-text tokenization (a SentencePiece
    /// word start), only in conversations that spell special tokens.
    ///
    /// # Errors
    /// As [`Self::encode_chat`], and [`Error::Template`] if no escape
    /// character is free (the content uses every private-use character).
    pub fn encode_chat_with(&self, messages: &[Message], limit: usize, opts: ChatOptions) -> Result<Option<Vec<u32>>> {
        encode_chat(&self.tokenizer, self.template.as_ref(), messages, limit, opts)
    }

    /// As [`Engine::encode_raw`], at most `limit` tokens ([`Tokenizer::encode_at_most`]).
    ///
    /// # Errors
    /// [`Error::PromptTooLong`], [`Error::Tokenizer`].
    pub fn encode_raw_at_most(&self, text: &str, limit: usize) -> Result<Vec<u32>> {
        encode_raw(&self.tokenizer, self.raw_bos, text, limit)
    }
}

/// A chat's ids: see [`Prompter::encode_chat_with`].
fn encode_chat(
    tok: &Tokenizer,
    template: Option<&ChatTemplate>,
    messages: &[Message],
    limit: usize,
    opts: ChatOptions,
) -> Result<Option<Vec<u32>>> {
    let Some(t) = template else { return Ok(None) };
    let think = opts.enable_thinking;
    if opts.content == ContentTokens::Special || messages.iter().all(|m| tok.find_special(&m.content, 0).is_none()) {
        return tok.encode_at_most(&t.render_with(messages, think)?, false, limit).map(Some);
    }
    // One escape character per special token spelled in the content: the
    // private-use planes 15 and 16, skipping characters the messages or
    // the template hold.
    let used: std::collections::HashSet<char> = messages.iter().flat_map(|m| m.content.chars()).collect();
    let mut free = (0xF0000u32..=0xFFFFD)
        .chain(0x100000..=0x10FFFD)
        .filter_map(char::from_u32)
        .filter(|c| !used.contains(c) && !t.uses_char(*c));
    let mut escape_of: Vec<Option<char>> = vec![None; tok.specials().len()];
    let mut escaped = Vec::with_capacity(messages.len());
    for m in messages {
        let mut text = String::with_capacity(m.content.len());
        let mut at = 0;
        while let Some((start, end, i)) = tok.find_special(&m.content, at) {
            let c = match escape_of[i] {
                Some(c) => c,
                None => {
                    let c = free.next().ok_or_else(|| {
                        Error::Template("the messages use every private-use character; nflash needs one free".into())
                    })?;
                    escape_of[i] = Some(c);
                    c
                }
            };
            text.push_str(&m.content[at..start]);
            text.push(c);
            at = end;
        }
        text.push_str(&m.content[at..]);
        escaped.push(Message { role: m.role.clone(), content: text });
    }
    let marks: Vec<(char, &str)> =
        escape_of.iter().zip(tok.specials()).filter_map(|(c, sp)| c.map(|c| (c, sp.text.as_str()))).collect();
    tok.encode_escaped_at_most(&t.render_with(&escaped, think)?, &marks, limit).map(Some)
}

/// A raw prompt's ids, at most `limit`: see [`Engine::encode_raw`].
fn encode_raw(tok: &Tokenizer, raw_bos: RawBos, text: &str, limit: usize) -> Result<Vec<u32>> {
    let ids = match raw_bos {
        RawBos::PostProcessor => tok.encode_at_most(text, true, limit)?,
        RawBos::Prepend(bos) => {
            let mut ids: Vec<u32> = bos.into_iter().collect();
            ids.extend(tok.encode_at_most(text, false, limit)?);
            ids
        }
    };
    if ids.len() > limit {
        return Err(Error::PromptTooLong { prompt: ids.len(), context: limit, reserve: 0 });
    }
    Ok(ids)
}

/// The model of `pack` with its FFN neuron clusters served by a
/// [`NeuronCache`] laid out as `cache` says (all hot: every cluster read
/// into memory at load; see [`CacheConfig::all_hot`]).
///
/// # Errors
/// As [`NeuronCache::open`] and [`Model::load`].
pub fn load_model<'a>(pack: &'a Pack, cache: &CacheConfig) -> Result<Model<'a>> {
    let source = NeuronCache::open(pack, cache)?;
    Model::load(pack, Box::new(source))
}
