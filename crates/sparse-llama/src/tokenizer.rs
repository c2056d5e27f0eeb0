//! Tokenizers: loaded from `tokenizer.json`, or rebuilt from GGUF metadata; and the
//! ChatML prompt format of instruct models.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::Result;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::{err, LlamaError};

/// GGUF token type of control tokens (`<|im_start|>` and friends).
const GGUF_TOKEN_CONTROL: i64 = 3;

fn tok_err(e: impl std::fmt::Display) -> candle_core::Error {
    LlamaError::Tokenizer(e.to_string()).into()
}

pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    if !path.exists() {
        return err(LlamaError::NotFound(format!(
            "{} (every checkpoint needs a tokenizer.json)",
            path.display()
        )));
    }
    Tokenizer::from_file(path).map_err(|e| {
        LlamaError::BadFile {
            path: path.to_path_buf(),
            detail: format!("not a valid tokenizer.json: {e}"),
        }
        .into()
    })
}

fn meta<'a>(content: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value> {
    match content.metadata.get(key) {
        Some(v) => Ok(v),
        None => err(LlamaError::Tokenizer(format!("GGUF has no '{key}'"))),
    }
}

fn as_i64(v: &gguf_file::Value) -> Option<i64> {
    v.to_i32()
        .map(i64::from)
        .or_else(|_| v.to_u32().map(i64::from))
        .or_else(|_| v.to_i64())
        .ok()
}

/// Rebuilds the HF tokenizer of a GGUF with a byte-level BPE (`tokenizer.ggml.model`
/// "gpt2"): vocab in index order, the merges, a digit-splitting + byte-level
/// pre-tokenizer and decoder, and control tokens as special added tokens.
pub fn tokenizer_from_gguf(content: &gguf_file::Content) -> Result<Tokenizer> {
    let model = meta(content, "tokenizer.ggml.model")?.to_string()?;
    if model != "gpt2" {
        return err(LlamaError::Unsupported(format!(
            "GGUF tokenizer model '{model}' (only byte-level BPE 'gpt2')"
        )));
    }
    let tokens = meta(content, "tokenizer.ggml.tokens")?.to_vec()?;
    let tokens: Vec<String> = tokens
        .iter()
        .map(|t| t.to_string().cloned())
        .collect::<Result<_>>()?;
    let merges = meta(content, "tokenizer.ggml.merges")?.to_vec()?;
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            let m = m.to_string()?;
            match m.split_once(' ') {
                Some((a, b)) => Ok((a.to_string(), b.to_string())),
                None => err(LlamaError::Tokenizer(format!("merge '{m}' has no space"))),
            }
        })
        .collect::<Result<_>>()?;
    let types: Vec<i64> = match content.metadata.get("tokenizer.ggml.token_type") {
        Some(v) => v.to_vec()?.iter().map(|t| as_i64(t).unwrap_or(1)).collect(),
        None => vec![1; tokens.len()],
    };
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = tokenizers::models::bpe::BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(tok_err)?;
    let mut tokenizer = Tokenizer::new(bpe);
    let pre = Sequence::new(vec![
        Digits::new(true).into(),
        ByteLevel::new(false, true, true).into(),
    ]);
    tokenizer.with_pre_tokenizer(Some(pre));
    tokenizer.with_decoder(Some(ByteLevel::new(false, true, true)));
    let specials: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &t)| t == GGUF_TOKEN_CONTROL)
        .map(|(tok, _)| AddedToken::from(tok.clone(), true))
        .collect();
    tokenizer.add_special_tokens(specials).map_err(tok_err)?;
    Ok(tokenizer)
}

/// How an instruct model wants a conversation laid out.
#[derive(Clone, Debug, PartialEq)]
pub enum ChatFormat {
    /// `<|im_start|>role\ncontent<|im_end|>\n`, then `<|im_start|>assistant\n`.
    ChatMl { default_system: Option<String> },
}

impl ChatFormat {
    /// Recognises the template of a GGUF / `tokenizer_config.json`.
    pub fn from_template(template: &str) -> Result<Self> {
        if !template.contains("<|im_start|>") {
            return err(LlamaError::Unsupported(
                "chat template: only ChatML (<|im_start|> ... <|im_end|>) templates are supported"
                    .into(),
            ));
        }
        // SmolLM2's template inserts a default system message when none is given.
        // Templates spell the newline either as a character or as a `\n` escape.
        let default_system = ["<|im_start|>system\n", "<|im_start|>system\\n"]
            .iter()
            .find_map(|head| {
                let at = template.find(head)?;
                let rest = &template[at + head.len()..];
                rest.find("<|im_end|>").map(|end| rest[..end].to_string())
            });
        let default_system =
            default_system.filter(|s| !s.contains("{{") && !s.contains("{%") && !s.is_empty());
        Ok(Self::ChatMl { default_system })
    }

    /// A conversation's opening up to where the user's first message begins (the
    /// system turn, then the user's header): a prompt from which a model writes a whole
    /// exchange, the user's message and the reply, as chat text to train on.
    pub fn user_turn_opening(&self, system: Option<&str>) -> String {
        let full = self.prompt(system, "");
        let header = "<|im_start|>user\n";
        let end = full.find(header).map_or(full.len(), |at| at + header.len());
        full[..end].to_string()
    }

    /// A conversation of `(role, content)` turns (`system`, `user`, `assistant`), ready
    /// for the assistant's next reply. The template's default system turn opens it when
    /// the conversation has none, as the template itself does.
    pub fn conversation<'a>(
        &self,
        turns: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<String> {
        match self {
            Self::ChatMl { default_system } => {
                let mut s = String::new();
                for (i, (role, content)) in turns.into_iter().enumerate() {
                    if !matches!(role, "system" | "user" | "assistant") {
                        return err(LlamaError::Invalid(format!(
                            "chat turn {i}: unknown role {role:?} (want system, user or assistant)"
                        )));
                    }
                    if i == 0 && role != "system" {
                        if let Some(sys) = default_system {
                            s.push_str(&format!("<|im_start|>system\n{sys}<|im_end|>\n"));
                        }
                    }
                    s.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
                }
                s.push_str("<|im_start|>assistant\n");
                Ok(s)
            }
        }
    }

    /// The prompt for one user turn, ready for the assistant's reply.
    pub fn prompt(&self, system: Option<&str>, user: &str) -> String {
        match self {
            Self::ChatMl { default_system } => {
                let mut s = String::new();
                if let Some(sys) = system.or(default_system.as_deref()) {
                    s.push_str(&format!("<|im_start|>system\n{sys}<|im_end|>\n"));
                }
                s.push_str(&format!(
                    "<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
                ));
                s
            }
        }
    }
}

/// A byte-level BPE over the 256 byte symbols, with no merges, plus `<s>` (id 256) and
/// `</s>` (id 257): a real tokenizer for random-weight models (tests, shape
/// benchmarks) that needs no vocabulary file.
pub fn byte_level_tokenizer() -> Result<Tokenizer> {
    let mut chars: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    chars.sort();
    let vocab: tokenizers::models::bpe::Vocab = chars
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    let bpe = tokenizers::models::bpe::BPE::builder()
        .vocab_and_merges(vocab, vec![])
        .build()
        .map_err(tok_err)?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, true, true)));
    tokenizer
        .add_special_tokens(vec![
            AddedToken::from("<s>", true),
            AddedToken::from("</s>", true),
        ])
        .map_err(tok_err)?;
    Ok(tokenizer)
}

#[cfg(test)]
mod tests {
    use super::ChatFormat;

    #[test]
    fn a_conversation_equals_the_one_turn_prompt_and_checks_roles() {
        let chat = ChatFormat::ChatMl {
            default_system: Some("Be brief.".into()),
        };
        let one = chat.conversation([("user", "Hi")]).unwrap();
        assert_eq!(one, chat.prompt(None, "Hi"));
        let own = chat
            .conversation([("system", "S"), ("user", "Hi")])
            .unwrap();
        assert_eq!(own, chat.prompt(Some("S"), "Hi"));
        let turns = chat
            .conversation([("user", "Hi"), ("assistant", "Hello"), ("user", "Bye")])
            .unwrap();
        assert!(turns.ends_with(
            "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
        ));
        assert!(chat.conversation([("robot", "x")]).is_err());
    }
}
