//! Chat templates: the packed Jinja template (from `tokenizer_config.json`)
//! rendered with minijinja and its Python-compatibility methods.

use serde::Serialize;

use crate::error::{Error, Result};

/// One chat message.
#[derive(Debug, Clone, Serialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
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
}

impl ChatTemplate {
    /// Compiles `source` (HF `chat_template`).
    ///
    /// # Errors
    /// [`Error::Template`] on a syntax error.
    pub fn new(source: &str, bos: Option<&str>, eos: Option<&str>) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source.to_string()).map_err(|e| Error::Template(e.to_string()))?;
        Ok(ChatTemplate { env, bos: bos.unwrap_or_default().to_string(), eos: eos.unwrap_or_default().to_string() })
    }

    /// Renders `messages` with `add_generation_prompt = true`.
    pub fn render(&self, messages: &[Message]) -> Result<String> {
        let tmpl = self.env.get_template("chat").map_err(|e| Error::Template(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => true,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })
        .map_err(|e| Error::Template(e.to_string()))
    }
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
}
