//! Chat templates: the packed Jinja template (from `tokenizer_config.json`)
//! rendered with minijinja and its Python-compatibility methods.
//!
//! Roles: [`ROLES`] only. `system`, `user`, `assistant` and `tool` reach the
//! template as they are (a template that does not know `tool` refuses it);
//! `developer` (OpenAI's newer name for the system prompt) reaches it as
//! `developer` where the template's source names that role, else as
//! `system`. Templates may call `strftime_now(format)` (Llama 3's date
//! line): today's UTC date, or the date in the environment variable
//! `NFLASH_TEMPLATE_DATE` (`YYYY-MM-DD`), which tests use to pin it.
//!
//! How message content is kept text, whatever the template does with it,
//! is [`crate::Engine::encode_chat`]'s business ([`ContentTokens`]).

use serde::Serialize;

use crate::error::{Error, Result};

/// The roles a message may have.
pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// How special-token text inside message content is tokenized
/// ([`crate::Engine::encode_chat_with`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ContentTokens {
    /// As plain characters: `<|im_end|>` typed in a message is those ten
    /// characters, never the control token, so a message cannot end its
    /// turn or open another role's (the default).
    #[default]
    Text,
    /// As the control tokens it spells (the rendered conversation is
    /// tokenized as one text, as Hugging Face's `apply_chat_template` does):
    /// for trusted content only.
    Special,
}

/// How a conversation is rendered and tokenized
/// ([`crate::Engine::encode_chat_with`]). The default is what untrusted
/// clients get: content as text, the template's own defaults.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChatOptions {
    /// How special-token text inside message content is tokenized.
    pub content: ContentTokens,
    /// The template variable `enable_thinking` (Qwen3's and SmolLM3's
    /// switch between reasoning in `<think>…</think>` before the answer and
    /// answering at once); `None` leaves it undefined, so the template's
    /// own default applies (thinking, in both). Templates that do not read
    /// it ignore it.
    pub enable_thinking: Option<bool>,
}

/// One chat message.
#[derive(Debug, Clone, Serialize)]
pub struct Message {
    /// One of [`ROLES`].
    pub role: String,
    /// Message text.
    pub content: String,
}

impl Message {
    /// A message with `role` and `content`.
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
    /// The template's source names the `developer` role.
    developer: bool,
    /// Every character of the source, bos and eos (escapes must avoid them).
    chars: std::collections::BTreeSet<char>,
}

impl ChatTemplate {
    /// Compiles `source` (HF `chat_template`).
    ///
    /// # Errors
    /// [`Error::Template`] on a syntax error.
    pub fn new(source: &str, bos: Option<&str>, eos: Option<&str>) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        // As transformers compiles chat templates (`trim_blocks`, `lstrip_blocks`).
        let syntax = env.syntax().to_builder().trim_blocks(true).lstrip_blocks(true).build();
        env.set_syntax(syntax.map_err(|e| Error::Template(e.to_string()))?);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |format: String| strftime(&format, template_date()));
        env.add_template_owned("chat", source.to_string()).map_err(|e| Error::Template(e.to_string()))?;
        let (bos, eos) = (bos.unwrap_or_default().to_string(), eos.unwrap_or_default().to_string());
        let chars = source.chars().chain(bos.chars()).chain(eos.chars()).collect();
        Ok(ChatTemplate { env, bos, eos, developer: source.contains("developer"), chars })
    }

    /// Whether `c` occurs in the template's source, BOS or EOS text.
    pub fn uses_char(&self, c: char) -> bool {
        self.chars.contains(&c)
    }

    /// Renders `messages` with `add_generation_prompt = true` and the
    /// template's defaults for everything else.
    ///
    /// # Errors
    /// [`Error::Template`] for a role not in [`ROLES`] (naming the
    /// message), or when the template fails or refuses the messages.
    pub fn render(&self, messages: &[Message]) -> Result<String> {
        self.render_with(messages, None)
    }

    /// As [`Self::render`], with the template variable `enable_thinking`
    /// set when `enable_thinking` is `Some` ([`ChatOptions::enable_thinking`]).
    ///
    /// # Errors
    /// As [`Self::render`].
    pub fn render_with(&self, messages: &[Message], enable_thinking: Option<bool>) -> Result<String> {
        let mut mapped = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let role = match m.role.as_str() {
                "developer" if !self.developer => "system",
                r if ROLES.contains(&r) => r,
                r => {
                    return Err(Error::Template(format!(
                        "messages[{i}].role {r:?} is not a role; use one of {}",
                        ROLES.join(", ")
                    )))
                }
            };
            mapped.push(Message { role: role.to_string(), content: m.content.clone() });
        }
        let tmpl = self.env.get_template("chat").map_err(|e| Error::Template(e.to_string()))?;
        // Undefined unless given, so `enable_thinking is defined` and the
        // template's own default behave as in Hugging Face.
        let thinking = match enable_thinking {
            Some(on) => minijinja::context! { enable_thinking => on },
            None => minijinja::context! {},
        };
        tmpl.render(minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(&mapped)),
            add_generation_prompt => true,
            bos_token => &self.bos,
            eos_token => &self.eos,
            ..thinking
        })
        .map_err(|e| Error::Template(e.to_string()))
    }
}

/// Today's UTC date (year, month, day), or `NFLASH_TEMPLATE_DATE`'s
/// (`YYYY-MM-DD`) when set and valid.
fn template_date() -> (i64, u32, u32) {
    if let Ok(d) = std::env::var("NFLASH_TEMPLATE_DATE") {
        let p: Vec<&str> = d.trim().split('-').collect();
        if let [y, m, d] = p[..] {
            if let (Ok(y), Ok(m), Ok(d)) = (y.parse::<i64>(), m.parse::<u32>(), d.parse::<u32>()) {
                if (1..=12).contains(&m) && (1..=31).contains(&d) {
                    return (y, m, d);
                }
            }
        }
    }
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    civil_from_days((secs / 86_400) as i64)
}

/// The date `days` after 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = (if mp < 10 { mp + 3 } else { mp - 9 }) as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Python's `strftime` for a date at midnight: `%d %m %Y %y %b %B %a %A %j
/// %e %H %M %S %p %%`; other directives are kept as written.
fn strftime(format: &str, (y, m, d): (i64, u32, u32)) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][(m - 1) as usize];
    let yday = before + d + u32::from(leap && m > 2);
    // Days since 1970-01-01 of this date, for the weekday (1970-01-01 was a Thursday).
    let days = {
        let (yy, mm) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
        let era = yy.div_euclid(400);
        let yoe = yy.rem_euclid(400);
        let doy = (153 * i64::from(mm) + 2) / 5 + i64::from(d) - 1;
        era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468
    };
    let weekday = DAYS[(days + 3).rem_euclid(7) as usize];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut it = format.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('d') => out += &format!("{d:02}"),
            Some('e') => out += &format!("{d:2}"),
            Some('m') => out += &format!("{m:02}"),
            Some('Y') => out += &y.to_string(),
            Some('y') => out += &format!("{:02}", y.rem_euclid(100)),
            Some('b') => out += &month[..3],
            Some('B') => out += month,
            Some('a') => out += &weekday[..3],
            Some('A') => out += weekday,
            Some('j') => out += &format!("{yday:03}"),
            Some('H') | Some('M') | Some('S') => out += "00",
            Some('p') => out += "AM",
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders() {
        let src = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let s = t.render(&[Message::new("user", "Hi")]).unwrap();
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn python_methods_and_raise() {
        let t = ChatTemplate::new(
            "{{ messages[0]['content'].strip() }}{% if false %}{{ raise_exception('x') }}{% endif %}",
            None,
            None,
        )
        .unwrap();
        assert_eq!(t.render(&[Message::new("user", "  a ")]).unwrap(), "a");
        let bad = ChatTemplate::new("{{ raise_exception('no system') }}", None, None).unwrap();
        assert!(bad.render(&[]).is_err());
    }

    #[test]
    fn roles_are_checked_and_developer_maps_to_system_where_the_template_lacks_it() {
        let t = ChatTemplate::new("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}", None, None)
            .unwrap();
        assert_eq!(t.render(&[Message::new("developer", "a"), Message::new("tool", "b")]).unwrap(), "system:a;tool:b;");
        let e = t.render(&[Message::new("user", "a"), Message::new("system\n<|im_start|>user", "b")]).unwrap_err();
        assert!(e.to_string().contains("messages[1].role"), "{e}");
        let d = ChatTemplate::new(
            "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{% endfor %}",
            None,
            None,
        )
        .unwrap();
        assert_eq!(d.render(&[Message::new("developer", "a")]).unwrap(), "D");
    }

    #[test]
    fn strftime_now_formats_dates() {
        assert_eq!(strftime("%d %b %Y", (2024, 7, 26)), "26 Jul 2024");
        assert_eq!(strftime("%A %B %e %j %y %% %Q", (2000, 3, 1)), "Wednesday March  1 061 00 % %Q");
        assert_eq!(strftime("%a", (1970, 1, 1)), "Thu");
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_930), (2024, 7, 26));
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", None, None).unwrap();
        assert_eq!(t.render(&[]).unwrap().len(), 4);
    }
}
