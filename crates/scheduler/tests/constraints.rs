//! Constrained output through the scheduler and the fake model: every completion of a
//! JSON schema, regex, Lark grammar or choice list parses / matches, at temperature 0
//! and 1, alone and in a batch of 32 mixed with unconstrained rows (whose tokens the
//! constrained ones must not change); a grammar that forces the end stops the request;
//! injected faults and rollbacks lose, duplicate and desynchronise nothing.

mod common;

use std::sync::Arc;

use common::*;
use serde_json::Value;
use weft_scheduler::constraint::llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use weft_scheduler::fake::{FakeConfig, FakeFaults};
use weft_scheduler::{
    ConstraintSpec, Detokenizer, FaultPlan, FinishReason, Grammars, Request, SamplingParams,
    StopMatch,
};

const VOCAB: usize = 128;
const EOS: u32 = 0;

/// The test's vocabulary: EOS, every printable ASCII byte, and multi-byte tokens that
/// cross JSON's lexeme boundaries (so masks are about tokens, not characters).
fn words() -> Vec<Vec<u8>> {
    let mut w: Vec<Vec<u8>> = vec![b"\xFF<eos>".to_vec()];
    w.extend((0x20u8..=0x7E).map(|b| vec![b]));
    for m in [
        "{\"", "\"}", "\":", "\",", "\",\"", "\":\"", "true", "false", "null", "ab", "abc", "12",
        "123", "00", "\"a", "(1", "+(", ")*", "yes", "no", "maybe", "=1", ",a", "ba", "cd", "[1",
        "],", "}]", "},{", "\n", "  ", "x=",
    ] {
        w.push(m.as_bytes().to_vec());
    }
    assert_eq!(w.len(), VOCAB);
    w
}

fn grammars() -> Grammars {
    let info = TokRxInfo::new(VOCAB as u32, EOS);
    let trie = TokTrie::from(&info, &words());
    Grammars::new(Arc::new(ApproximateTokEnv::new(trie)), VOCAB).expect("grammars")
}

struct Detok(Vec<Vec<u8>>);

impl Detokenizer for Detok {
    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        let mut b = Vec::new();
        for &i in ids {
            if i != EOS {
                b.extend_from_slice(self.0.get(i as usize).ok_or("id outside vocabulary")?);
            }
        }
        Ok(String::from_utf8_lossy(&b).into_owned())
    }
}

fn fake() -> FakeConfig {
    FakeConfig {
        vocab_size: VOCAB,
        eos_token_ids: vec![EOS],
        ..fake_config()
    }
}

/// A constraint of the test set, with the check its completions must pass.
struct Case {
    name: &'static str,
    spec: ConstraintSpec,
    check: fn(&str) -> Result<(), String>,
}

fn full_match(rx: &str, s: &str) -> Result<(), String> {
    let re = regex::Regex::new(&format!("^(?:{rx})$")).map_err(|e| e.to_string())?;
    if re.is_match(s) {
        Ok(())
    } else {
        Err(format!("{s:?} does not match /{rx}/"))
    }
}

/// The object `s` holds (indexing a missing key gives `Value::Null`), and its size.
fn json(s: &str) -> Result<(Value, usize), String> {
    match serde_json::from_str::<Value>(s) {
        Ok(Value::Object(m)) => {
            let n = m.len();
            Ok((Value::Object(m), n))
        }
        Ok(v) => Err(format!("not an object: {v}")),
        Err(e) => Err(format!("{s:?} is not JSON: {e}")),
    }
}

const PERSON: &str = r#"{"type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "admin": {"type": "boolean"}
  },
  "required": ["name", "age", "admin"],
  "additionalProperties": false}"#;

const ENUMS: &str = r#"{"type": "object",
  "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3}
  },
  "required": ["color", "tags"],
  "additionalProperties": false}"#;

const NESTED: &str = r#"{"type": "object",
  "properties": {
    "point": {"type": "object",
      "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                     "y": {"type": "integer", "minimum": -9, "maximum": 9}},
      "required": ["x", "y"], "additionalProperties": false},
    "label": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]}
  },
  "required": ["point", "label"],
  "additionalProperties": false}"#;

const DATE_RX: &str = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]";
const CODE_RX: &str = r"[A-Z]{2}[0-9]{3}(-[a-z]{1,4})?";

/// Bounded, so random picks end well inside max_tokens.
const PAIRS: &str = r#"start: pair | pair "," pair | pair "," pair "," pair
pair: KEY "=" NUM
KEY: /[a-z]{1,3}/
NUM: /[0-9]{1,3}/"#;

/// Nested sums of products of digits, at most two levels deep.
const ARITH: &str = r#"start: sum
sum: prod | "(" prod "+" prod ")"
prod: DIGIT | "(" DIGIT "*" DIGIT ")"
DIGIT: /[0-9]/"#;

fn arith(s: &str) -> Result<(), String> {
    fn digit(s: &[u8], i: &mut usize) -> bool {
        let ok = s.get(*i).is_some_and(u8::is_ascii_digit);
        *i += usize::from(ok);
        ok
    }
    fn lit(s: &[u8], i: &mut usize, c: u8) -> bool {
        let ok = s.get(*i) == Some(&c);
        *i += usize::from(ok);
        ok
    }
    fn prod(s: &[u8], i: &mut usize) -> bool {
        if lit(s, i, b'(') {
            digit(s, i) && lit(s, i, b'*') && digit(s, i) && lit(s, i, b')')
        } else {
            digit(s, i)
        }
    }
    fn sum(s: &[u8], i: &mut usize) -> bool {
        let at = *i;
        if lit(s, i, b'(') && prod(s, i) && lit(s, i, b'+') && prod(s, i) && lit(s, i, b')') {
            return true;
        }
        *i = at;
        prod(s, i)
    }
    let b = s.as_bytes();
    let mut i = 0;
    if sum(b, &mut i) && i == b.len() {
        Ok(())
    } else {
        Err(format!("{s:?} is not a sum of products"))
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "person",
            spec: ConstraintSpec::JsonSchema(PERSON.into()),
            check: |s| {
                let (m, n) = json(s)?;
                let ok = n == 3
                    && m["name"].as_str().is_some_and(|n| n.chars().count() <= 6)
                    && m["age"].as_u64().is_some_and(|a| a <= 150)
                    && m["admin"].is_boolean();
                ok.then_some(())
                    .ok_or(format!("{s} breaks the person schema"))
            },
        },
        Case {
            name: "enums",
            spec: ConstraintSpec::JsonSchema(ENUMS.into()),
            check: |s| {
                let (m, n) = json(s)?;
                let color = m["color"].as_str().unwrap_or_default();
                let tags = m["tags"].as_array().cloned().unwrap_or_default();
                let ok = n == 2
                    && ["red", "green", "blue"].contains(&color)
                    && m["tags"].is_array()
                    && tags.len() <= 3
                    && tags
                        .iter()
                        .all(|t| t.as_str().is_some_and(|t| t.chars().count() <= 3));
                ok.then_some(())
                    .ok_or(format!("{s} breaks the enums schema"))
            },
        },
        Case {
            name: "nested",
            spec: ConstraintSpec::JsonSchema(NESTED.into()),
            check: |s| {
                let (m, n) = json(s)?;
                let p = m["point"].as_object().cloned().unwrap_or_default();
                let coord = |k: &str| {
                    p.get(k)
                        .and_then(Value::as_i64)
                        .is_some_and(|v| v.abs() <= 9)
                };
                let label = &m["label"];
                let ok = n == 2
                    && p.len() == 2
                    && coord("x")
                    && coord("y")
                    && (label.is_null() || label.as_str().is_some_and(|l| l.chars().count() <= 4));
                ok.then_some(())
                    .ok_or(format!("{s} breaks the nested schema"))
            },
        },
        Case {
            name: "date",
            spec: ConstraintSpec::Regex(DATE_RX.into()),
            check: |s| full_match(DATE_RX, s),
        },
        Case {
            name: "code",
            spec: ConstraintSpec::Regex(CODE_RX.into()),
            check: |s| full_match(CODE_RX, s),
        },
        Case {
            name: "pairs",
            spec: ConstraintSpec::Lark(PAIRS.into()),
            check: |s| full_match(r"[a-z]{1,3}=[0-9]{1,3}(,[a-z]{1,3}=[0-9]{1,3}){0,2}", s),
        },
        Case {
            name: "arith",
            spec: ConstraintSpec::Lark(ARITH.into()),
            check: arith,
        },
        Case {
            name: "choice",
            spec: ConstraintSpec::Choice(vec!["yes".into(), "no".into(), "maybe not".into()]),
            check: |s| {
                ["yes", "no", "maybe not"]
                    .contains(&s)
                    .then_some(())
                    .ok_or(format!("{s:?} is not a choice"))
            },
        },
    ]
}

fn request(i: usize, g: &Grammars, spec: Option<&ConstraintSpec>, temperature: f32) -> Request {
    let mut rng = rng(1000 + i as u64);
    let mut r = Request::new(
        ["a", "b"][i % 2],
        (0..3 + i % 7)
            .map(|_| 1 + below(&mut rng, 126) as u32)
            .collect(),
        160,
    );
    r.seed = Some(7 + i as u64);
    r.request_id = Some(format!("r{i}"));
    r.sampling = SamplingParams {
        temperature,
        ..SamplingParams::default()
    };
    // Unconstrained rows run to max_tokens (so they share many steps with the others).
    r.ignore_eos = spec.is_none();
    r.constraint = spec.map(|s| g.compile(s).expect("compiles"));
    r
}

fn detok() -> Arc<dyn Detokenizer> {
    Arc::new(Detok(words()))
}

fn text_of(o: &Outcome) -> String {
    let ids: Vec<u32> = o.tokens.iter().copied().filter(|&t| t != EOS).collect();
    Detok(words()).decode(&ids).unwrap()
}

/// Checks every constrained outcome of `run` ended by its constraint (STOP) with text
/// its case accepts; returns how many there were.
fn check_constrained(run: &Run, specs: &[(Option<usize>, Spec)], cases: &[Case]) -> usize {
    let mut n = 0;
    for ((case, _), o) in specs.iter().zip(&run.outcomes) {
        let Some(c) = case else { continue };
        let case = &cases[*c];
        let f = o.finished.as_ref().expect("finished");
        assert_eq!(
            (f.reason, &f.error),
            (FinishReason::Stop, &None),
            "{}: {:?} after {:?}",
            case.name,
            f,
            text_of(o)
        );
        assert!(
            matches!(f.stop, Some(StopMatch::Constraint(_))),
            "{}: {:?}",
            case.name,
            f.stop
        );
        // What was streamed is what the tokens say (the EOS that ended it adds nothing).
        assert_eq!(o.text, text_of(o), "{}", case.name);
        if let Err(e) = (case.check)(&o.text) {
            panic!("{}: {e}", case.name);
        }
        n += 1;
    }
    n
}

fn specs_for(
    g: &Grammars,
    cases: &[Case],
    temperature: f32,
    mixed: usize,
) -> Vec<(Option<usize>, Spec)> {
    (0..mixed)
        .map(|i| {
            // Every other row constrained, cycling through the cases.
            let case = (i % 2 == 0).then_some((i / 2) % cases.len());
            let spec = case.map(|c| &cases[c].spec);
            (case, Spec::at(0, request(i, g, spec, temperature)))
        })
        .collect()
}

fn run_specs(specs: &[(Option<usize>, Spec)], cfg: weft_scheduler::SchedulerConfig) -> Run {
    let s: Vec<Spec> = specs.iter().map(|(_, s)| s.clone()).collect();
    run_detok(
        cfg,
        fake(),
        FakeFaults::default(),
        &s,
        detok(),
        |_, _, _| {},
    )
}

#[test]
fn every_completion_matches_alone_and_in_a_mixed_batch_of_32() {
    let g = grammars();
    let cases = cases();
    for temperature in [0.0, 1.0] {
        // Alone: one constrained request per run.
        for (c, case) in cases.iter().enumerate() {
            for seed_row in [0, 2] {
                let specs = vec![(
                    Some(c),
                    Spec::at(0, request(seed_row, &g, Some(&case.spec), temperature)),
                )];
                let r = run_specs(&specs, sched_config());
                assert_clean(&r);
                assert_eq!(check_constrained(&r, &specs, &cases), 1);
            }
        }
        // 32 rows, half constrained, every case at least once.
        let specs = specs_for(&g, &cases, temperature, 32);
        let mixed = run_specs(&specs, sched_config());
        assert_clean(&mixed);
        assert_eq!(check_constrained(&mixed, &specs, &cases), 16);
        let st = mixed.sched.stats();
        // One mask per constrained pick: the EOS or last token of each plus the rest.
        let constrained_tokens: usize = specs
            .iter()
            .zip(&mixed.outcomes)
            .filter(|((c, _), _)| c.is_some())
            .map(|(_, o)| o.tokens.len())
            .sum();
        assert_eq!(st.constraint_masks as usize, constrained_tokens);
        assert!(st.constraint_mask_seconds > 0.0);
        // Steps with constrained rows pipeline (the mask of step n+1 computed while
        // its forward is queued), streaming exactly what one step at a time does.
        let mut one = sched_config();
        one.pipeline = false;
        let stepwise = run_specs(&specs, one);
        assert_same_streams(&stepwise, &mixed);
        assert_eq!(stepwise.sched.stats().pipelined_steps, 0);
        assert!(
            st.pipelined_steps * 2 > st.steps,
            "{} of {} steps pipelined",
            st.pipelined_steps,
            st.steps
        );
        assert_eq!(stepwise.sched.stats().constraint_masks, st.constraint_masks);
        let f = mixed.sched.model().stats();
        assert!(f.deferred > 0 && f.sampling_calls == f.deferred, "{f:?}");
        // The unconstrained rows stream exactly what they do without the others.
        let plain: Vec<(Option<usize>, Spec)> =
            specs.iter().filter(|(c, _)| c.is_none()).cloned().collect();
        let alone = run_specs(&plain, sched_config());
        let mixed_plain: Vec<&Outcome> = specs
            .iter()
            .zip(&mixed.outcomes)
            .filter(|((c, _), _)| c.is_none())
            .map(|(_, o)| o)
            .collect();
        for (a, b) in alone.outcomes.iter().zip(mixed_plain) {
            assert_eq!(a.tokens, b.tokens);
            assert!(a.tokens.len() > 100, "unconstrained rows run long");
        }
        assert_eq!(alone.sched.stats().constraint_masks, 0);
        assert!(alone.sched.stats().pipelined_steps > 0);
    }
}

#[test]
fn a_grammar_that_forces_the_end_stops_without_an_eos_step() {
    let g = grammars();
    for temperature in [0.0, 1.0] {
        for i in 0..6 {
            let spec = ConstraintSpec::Choice(vec!["yes".into(), "no".into()]);
            let mut req = request(i, &g, Some(&spec), temperature);
            // The end is the grammar's, not EOS's.
            req.ignore_eos = true;
            let specs = vec![(None, Spec::at(0, req))];
            let r = run_specs(&specs, sched_config());
            assert_clean(&r);
            let o = &r.outcomes[0];
            let f = o.finished.as_ref().unwrap();
            assert_eq!(f.reason, FinishReason::Stop);
            assert_eq!(f.stop, Some(StopMatch::Constraint(None)));
            assert!(!o.tokens.contains(&EOS));
            assert!(["yes", "no"].contains(&o.text.as_str()), "{:?}", o.text);
            assert_eq!(f.usage.generated_tokens, o.tokens.len());
        }
    }
    // Where the grammar may go on or end, an EOS pick ends it (with STOP, no text).
    let mut eos_ends = 0;
    for i in 0..24 {
        let spec = ConstraintSpec::Regex("[a-c]{1,30}".into());
        let specs = vec![(None, Spec::at(0, request(i, &g, Some(&spec), 1.0)))];
        let r = run_specs(&specs, sched_config());
        let o = &r.outcomes[0];
        let f = o.finished.as_ref().unwrap();
        assert_eq!(f.reason, FinishReason::Stop);
        full_match("[a-c]{1,30}", &o.text).unwrap();
        if f.stop == Some(StopMatch::Constraint(Some(EOS))) {
            assert_eq!(o.tokens.last(), Some(&EOS));
            eos_ends += 1;
        }
    }
    assert!(
        eos_ends > 0,
        "no request picked EOS where the regex may end"
    );
}

#[test]
fn faults_and_rollbacks_with_constrained_rows_lose_nothing() {
    let g = grammars();
    let cases = cases();
    for temperature in [0.0, 1.0] {
        let specs = specs_for(&g, &cases, temperature, 32);
        let clean = run_specs(&specs, sched_config());
        assert_clean(&clean);
        let mut cfg = sched_config();
        // Every scheduler fault point, at random, and model faults in forward, commit
        // and collect: streams equal the fault-free run's, and (verify_rollback) every
        // rollback restores the state, each constraint's consumed tokens included.
        cfg.faults = FaultPlan::random(31 + temperature as u64, 0.08);
        cfg.max_step_retries = 60;
        let faults = FakeFaults {
            random: Some((9, 0.05)),
            fail_after_layer: 2,
            collect_fail_calls: vec![3, 4, 9],
            sampling_fail_calls: vec![2, 5, 6, 12],
            ..Default::default()
        };
        let s: Vec<Spec> = specs.iter().map(|(_, s)| s.clone()).collect();
        let faulty = run_detok(cfg, fake(), faults, &s, detok(), |_, _, _| {});
        assert_clean(&faulty);
        let st = faulty.sched.stats();
        assert!(st.rollbacks > 10, "rollbacks {}", st.rollbacks);
        assert_eq!(st.failed_steps, 0);
        assert_same_streams(&clean, &faulty);
        assert_eq!(check_constrained(&faulty, &specs, &cases), 16);
        assert_eq!(faulty.sched.model().stats().failed_samplings, 4);
        // Retried steps reused their masks: one per constrained pick, as without faults.
        assert_eq!(
            st.constraint_masks,
            clean.sched.stats().constraint_masks,
            "masks recomputed after rollbacks"
        );
    }
}

#[test]
fn preempted_constrained_rows_resume_where_their_constraint_is() {
    let g = grammars();
    let cases = cases();
    let specs = specs_for(&g, &cases, 1.0, 32);
    let s: Vec<Spec> = specs.iter().map(|(_, s)| s.clone()).collect();
    // Few KV blocks: rows are preempted and recomputed mid-output.
    let fake = FakeConfig {
        kv_blocks: 24,
        ..fake()
    };
    let mut cfg = sched_config();
    cfg.kv_watermark_blocks = 2;
    let tight = run_detok(cfg, fake, FakeFaults::default(), &s, detok(), |_, _, _| {});
    assert_clean(&tight);
    assert!(tight.sched.stats().preemptions > 0);
    let roomy = run_specs(&specs, sched_config());
    assert_same_streams(&roomy, &tight);
    assert_eq!(check_constrained(&tight, &specs, &cases), 16);
}

#[test]
fn bad_constraints_are_refused_with_a_reason() {
    let g = grammars();
    for (spec, want) in [
        (
            ConstraintSpec::JsonSchema("{not json".into()),
            "not valid JSON",
        ),
        (
            ConstraintSpec::JsonSchema("[1, 2]".into()),
            "must be an object",
        ),
        (
            ConstraintSpec::JsonSchema(r#"{"type": "no-such-type"}"#.into()),
            "",
        ),
        (ConstraintSpec::Regex("a(b".into()), ""),
        (ConstraintSpec::Regex(String::new()), "empty"),
        (ConstraintSpec::Lark("start: undefined_rule".into()), ""),
        (ConstraintSpec::Lark("   ".into()), "empty"),
        (ConstraintSpec::Choice(vec![]), "empty"),
        (
            ConstraintSpec::Choice(vec!["a".into(), String::new()]),
            "choice 1 is empty",
        ),
    ] {
        let e = g.compile(&spec).expect_err(&format!("{spec:?} compiled"));
        assert!(e.contains(want), "{spec:?}: {e}");
        assert!(!e.is_empty() && e.len() < 400, "{spec:?}: {e}");
    }
    // A constraint built for another vocabulary is refused at admission.
    let other = {
        let mut w = words();
        w.extend((0..32).map(|i| format!("\u{1}{i}").into_bytes()));
        let info = TokRxInfo::new(w.len() as u32, EOS);
        Grammars::new(
            Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &w))),
            w.len(),
        )
        .unwrap()
    };
    let mut req = request(0, &g, None, 0.0);
    req.constraint = Some(other.compile(&ConstraintSpec::JsonObject).unwrap());
    let r = run_specs(&[(None, Spec::at(0, req))], sched_config());
    let e = r.outcomes[0].submit_error.as_ref().expect("refused");
    assert!(e.to_string().contains("compiled for"), "{e}");
}

/// Constrained greedy rows speculate: each prompt-lookup draft is cut where the
/// constraint rejects it, and every draft position picks under the mask of the
/// constraint's state after the draft tokens before it. Streams are exactly those of
/// plain decoding (a position picked under the wrong mask would differ or fail its
/// step), alone, mixed with unconstrained rows, and under injected faults.
#[test]
fn constrained_drafts_pick_under_each_positions_mask() {
    let g = grammars();
    let mut cases = cases();
    // Output the looping fake repeats, so drafts are accepted inside the constraint.
    cases.push(Case {
        name: "looping regex",
        spec: ConstraintSpec::Regex("[a-e]{4,60}".into()),
        check: |s| full_match("[a-e]{4,60}", s),
    });
    let looping = || FakeConfig {
        vocab_size: VOCAB,
        eos_token_ids: vec![EOS],
        ..looping_fake()
    };
    let run = |specs: &[(Option<usize>, Spec)], speculate: usize, faults: Option<u64>| {
        let mut cfg = sched_config();
        cfg.speculate = speculate;
        cfg.speculate_step_tokens = usize::MAX;
        let mut fake_faults = FakeFaults::default();
        if let Some(seed) = faults {
            cfg.faults = FaultPlan::random(seed, 0.08);
            cfg.max_step_retries = 60;
            fake_faults = FakeFaults {
                random: Some((seed, 0.05)),
                fail_after_layer: 2,
                ..Default::default()
            };
        }
        let s: Vec<Spec> = specs.iter().map(|(_, s)| s.clone()).collect();
        run_detok(cfg, looping(), fake_faults, &s, detok(), |_, _, _| {})
    };
    // Every row constrained (so what is accepted is theirs), then mixed.
    let only: Vec<(Option<usize>, Spec)> = (0..2 * cases.len())
        .map(|i| {
            let c = i % cases.len();
            (
                Some(c),
                Spec::at(0, request(i, &g, Some(&cases[c].spec), 0.0)),
            )
        })
        .collect();
    let mixed = specs_for(&g, &cases, 0.0, 24);
    for (specs, constrained) in [(&only, only.len()), (&mixed, 12)] {
        let plain = run(specs, 0, None);
        assert_clean(&plain);
        assert_eq!(check_constrained(&plain, specs, &cases), constrained);
        let spec = run(specs, 4, None);
        assert_clean(&spec);
        assert_same_streams(&plain, &spec);
        assert_eq!(check_constrained(&spec, specs, &cases), constrained);
        let st = spec.sched.stats();
        assert!(
            st.accepted_tokens > 0,
            "drafted {} accepted {}",
            st.draft_tokens,
            st.accepted_tokens
        );
        assert!(st.steps < plain.sched.stats().steps);
        // Each kept draft token costs a mask for the position after it: accepted ones
        // the mask plain decoding computes a step later, rejected ones one more.
        assert!(st.constraint_masks >= plain.sched.stats().constraint_masks);
        let faulty = run(specs, 4, Some(17));
        assert_clean(&faulty);
        assert!(faulty.sched.stats().rollbacks > 5);
        assert_eq!(faulty.sched.stats().failed_steps, 0);
        assert_same_streams(&plain, &faulty);
    }
}
