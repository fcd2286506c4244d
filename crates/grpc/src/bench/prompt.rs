//! Unique benchmark prompts.
//!
//! A prompt is a short header that differs for every request (a per-run nonce
//! and the request counter) followed by random common English words. The
//! header comes first, so no two prompts share more than a token or two of
//! prefix and a server's prefix cache cannot make results look better than
//! they are — not within a run, nor across runs (the nonce changes per run).
//!
//! The bench has no tokenizer: it aims at `n` tokens by writing about `n`
//! words, each common enough to be one token (with its leading space) in the
//! byte-level BPE vocabularies of Llama/Qwen/SmolLM-style models (every word
//! in the list is a single token for SmolLM2-135M's tokenizer). The
//! server-reported prompt length (`usage.prompt_tokens`) is what the report
//! shows as measured.

use rand::Rng;

/// Short, frequent English words (one BPE token each, with a leading space,
/// in the common vocabularies).
#[rustfmt::skip]
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at",
    "from", "his", "her", "it", "an", "were", "are", "which", "this", "be", "or", "has", "had",
    "one", "first", "new", "after", "who", "they", "have", "two", "their", "she", "been", "other",
    "when", "there", "all", "time", "during", "into", "school", "more", "may", "years", "over",
    "only", "year", "most", "would", "world", "city", "some", "where", "between", "later", "three",
    "state", "such", "then", "national", "used", "made", "known", "under", "many", "university",
    "united", "while", "part", "season", "team", "these", "american", "than", "film", "second",
    "born", "south", "became", "well", "war", "main", "including", "both", "series", "people",
    "north", "group", "music", "through", "out", "about", "up", "no", "can", "not", "its", "he",
    "we", "you", "but", "so", "what", "said", "each", "how", "if", "will", "way", "many", "day",
    "could", "make", "like", "long", "look", "more", "write", "go", "see", "number", "sound",
    "water", "call", "oil", "now", "find", "down", "come", "did", "get", "word", "back", "work",
    "place", "good", "man", "give", "name", "very", "just", "form", "great", "help", "line",
    "turn", "cause", "much", "mean", "before", "move", "right", "boy", "old", "too", "same",
    "tell", "does", "set", "want", "air", "play", "small", "end", "put", "home", "read", "hand",
    "port", "large", "spell", "add", "even", "land", "here", "must", "big", "high", "act", "why",
    "ask", "men", "change", "went", "light", "kind", "off", "need", "house", "picture", "try",
    "us", "again", "animal", "point", "mother", "near", "build", "self", "earth", "father", "head",
    "stand", "own", "page", "should", "country", "found", "answer", "grow", "study", "still",
    "learn", "plant", "cover", "food", "sun", "four", "thought", "let", "keep", "eye", "never",
    "last", "door", "tree", "cross", "farm", "hard", "start", "might", "story", "saw", "far",
    "sea", "draw", "left", "late", "run", "while", "press", "close", "night", "real", "life",
    "few", "stop", "open", "seem", "together", "next", "white", "children", "begin", "got", "walk",
    "example", "ease", "paper", "often", "always", "those", "mark", "book", "letter", "until",
    "mile", "river", "car", "feet", "care", "carry", "took", "rain", "eat", "room", "friend",
    "began", "idea", "fish", "mountain", "north", "once", "base", "hear", "horse", "cut", "sure",
    "watch", "color", "face", "wood", "enough", "plain", "girl", "usual", "young", "ready",
    "above", "ever", "red", "list", "though", "feel", "talk", "bird", "soon", "body", "dog",
    "family", "direct", "pose", "leave", "song", "measure", "state", "product", "black", "short",
    "class", "wind", "question", "happen", "complete", "ship", "area", "half", "rock", "order",
    "fire", "problem", "piece", "told", "knew", "pass", "farm", "top", "whole", "king", "size",
    "heard", "best", "hour", "better", "true", "hundred", "five", "remember", "step", "early",
    "hold", "west", "ground", "interest", "reach", "fast", "sing", "listen", "six", "table",
    "travel", "less", "morning", "ten", "simple", "several", "toward", "war", "lay", "against",
    "pattern", "slow", "center", "love", "person", "money", "serve", "appear", "road", "map",
];

/// Tokens the header is assumed to take (digits and hex letters often
/// tokenize one by one: SmolLM2's tokenizer gives 12-14 for it).
const HEADER_TOKENS: u32 = 12;

/// Makes the prompt of request `index` aiming at `tokens` tokens. `nonce`
/// tells runs apart; `rng` picks the words (seeded per request, so prompts
/// are reproducible up to the nonce).
pub fn make_prompt<R: Rng + ?Sized>(nonce: u32, index: u64, tokens: u32, rng: &mut R) -> String {
    let words = tokens.saturating_sub(HEADER_TOKENS).max(1) as usize;
    let mut s = String::with_capacity(32 + words * 7);
    s.push_str(&format!("[{nonce:08x}-{index}]"));
    for _ in 0..words {
        s.push(' ');
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn prompts_are_unique_and_sized() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let a = make_prompt(0xabc, 0, 128, &mut rng);
        let b = make_prompt(0xabc, 1, 128, &mut rng);
        let c = make_prompt(0xabd, 0, 128, &mut rng);
        assert!(a.starts_with("[00000abc-0] "));
        assert_ne!(a, b);
        assert_ne!(a, c);
        // The prefix two prompts share ends inside the header.
        let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
        assert!(common < 12, "{common}");
        assert_eq!(a.split(' ').count(), 1 + 116);
        assert_eq!(make_prompt(1, 5, 1, &mut rng).split(' ').count(), 2);
        assert!(WORDS
            .iter()
            .all(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_lowercase())));
    }
}
