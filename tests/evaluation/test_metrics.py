"""The metrics on hand-made cases: RULER string match, LongBench scores, boxed math answers."""

import pytest

from evaluation.metrics import (
    best_over_references,
    boxed_match,
    classification_score,
    code_sim_score,
    count_score,
    last_boxed,
    normalize_answer,
    normalize_integer_answer,
    normalize_zh_answer,
    qa_f1_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_l_score,
    sample_score,
    string_match_all,
    string_match_part,
    token_f1,
)


def test_string_match_all():
    predictions = ["The numbers are 123 and 456.", "nothing here", "ABC"]
    references = [["123", "456"], ["7"], ["abc", "def"]]
    # (1 + 0 + 0.5) / 3, in percent; matching ignores case.
    assert string_match_all(predictions, references) == pytest.approx(50.0)


def test_string_match_part():
    predictions = ["Paris is the answer", "no", "London or Rome"]
    references = [["paris", "france"], ["yes"], ["Rome", "Milan"]]
    assert string_match_part(predictions, references) == pytest.approx(200 / 3)


def test_empty_and_bad_input():
    assert string_match_all([], []) == 0.0
    with pytest.raises(ValueError, match="predictions"):
        string_match_all(["a"], [])
    with pytest.raises(ValueError, match="non-empty"):
        string_match_part(["a"], [[]])
    with pytest.raises(TypeError):
        string_match_all("abc", [["a"]])


def test_sample_score_uses_the_task_metric():
    assert sample_score("niah_multivalue", "1 and 2", ["1", "2", "3", "4"]) == pytest.approx(50.0)
    assert sample_score("qa", "it is blue", ["blue", "green"]) == 100.0
    with pytest.raises(ValueError, match="Unknown task"):
        sample_score("nope", "", ["a"])


# --- LongBench -----------------------------------------------------------------------------------------------------
def test_normalize_answer_edge_cases():
    assert normalize_answer("The Eiffel  Tower.") == "eiffel tower"
    assert normalize_answer("An apple, a pear and THE plum!") == "apple pear and plum"
    # Articles go only as whole words; punctuation is deleted without a space, before articles are removed.
    assert normalize_answer("Theatre of the anthem") == "theatre of anthem"
    assert normalize_answer("e-mail (U.S.A.)") == "email usa"
    assert normalize_answer("a-the") == "athe"
    assert normalize_answer("  \n ") == ""
    assert normalize_zh_answer("老园丁。 ！Ａ？“好”…") == "老园丁ａ好"


def test_qa_f1():
    assert qa_f1_score("The Eiffel Tower", "eiffel tower.") == 1.0
    assert qa_f1_score("Paris", "London") == 0.0
    assert qa_f1_score("", "London") == 0.0 and qa_f1_score("the", "a") == 0.0  # nothing left after normalising
    # "red red blue" vs "red green": overlap 1 (multiset), P 1/3, R 1/2.
    assert qa_f1_score("red red blue", "red green") == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
    assert token_f1(["a", "a"], ["a", "a", "b"]) == pytest.approx(2 * 1 * (2 / 3) / (1 + 2 / 3))


def test_rouge_l():
    # LCS of "the cat sat on the mat" / "the cat lay on the mat" is 5 tokens of 6 and 6.
    assert rouge_l_score("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    assert rouge_l_score("a b c d", "d c b a") == pytest.approx(0.25)  # order matters: LCS 1
    assert rouge_l_score("Cat.", "cat") == 0.0  # case-sensitive; periods are not tokens
    assert rouge_l_score("end. Start", "end Start") == 1.0
    assert rouge_l_score("", "x") == 0.0 and rouge_l_score("x", " . ") == 0.0
    assert rouge_l_score("a b", "a x b y") == pytest.approx(2 * 1 * 0.5 / 1.5)


def test_classification_score():
    classes = ["City", "Country", "Individual", "Other location", "location"]
    assert classification_score("City", "City", all_classes=classes) == 1.0
    assert classification_score("City or Country", "City", all_classes=classes) == 0.5
    assert classification_score("Country", "City", all_classes=classes) == 0.0
    # "location" inside the reference "Other location" is not a competing guess.
    assert classification_score("Other location", "Other location", all_classes=classes) == 1.0
    assert classification_score("Nothing", "City", all_classes=classes) == 0.0


def test_retrieval_count_and_code_scores():
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("Paragraph 12, or maybe 3", "Paragraph 12") == 0.5
    assert retrieval_score("no idea", "Paragraph 12") == 0.0
    assert retrieval_zh_score("段落3", "段落3") == 1.0
    with pytest.raises(ValueError, match="names a paragraph"):
        retrieval_score("1", "12")
    assert count_score("There are 7 unique paragraphs", "7") == 1.0
    assert count_score("7 or 8", "7") == 0.5 and count_score("seven", "7") == 0.0
    # The first line without a fence or a comment is the predicted line.
    assert code_sim_score("```python\n# comment\n    return a + b\n```", "    return a + b") == 1.0
    assert code_sim_score("\n\nx = 1", "x = 2") == pytest.approx(0.8)  # difflib: 2 * 4 / 10
    assert code_sim_score("# only a comment", "x = 1") == 0.0


def test_best_over_references():
    assert best_over_references("qa_f1", "Paris", ["London", "paris"]) == 1.0
    assert best_over_references("classification", "City", ["City"], ["City", "Country"]) == 1.0
    with pytest.raises(ValueError, match="Unknown LongBench metric"):
        best_over_references("bleu", "a", ["a"])
    with pytest.raises(ValueError, match="non-empty"):
        best_over_references("qa_f1", "a", [])


# --- boxed answers -------------------------------------------------------------------------------------------------
def test_last_boxed_handles_nesting_and_truncation():
    assert last_boxed("first \\boxed{1}, finally \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\text{{42}}}") == "\\text{{42}}"
    assert last_boxed("\\boxed {7}") == "7" and last_boxed("\\fbox{8}") == "8"
    assert last_boxed("no answer") is None
    assert last_boxed("\\boxed{3} then \\boxed{\\frac{1}{") is None  # cut off by the token budget


def test_normalize_integer_answer():
    for text in ("042", "42", " 42. ", "$42$", "\\text{42}", "\\textbf{\\text{42}}", "+42", "42.0", "42^\\circ"):
        assert normalize_integer_answer(text) == "42", text
    assert normalize_integer_answer("1,000") == normalize_integer_answer("1{,}000") == "1000"
    assert normalize_integer_answer("-0") == "0" and normalize_integer_answer("-5") == "-5"
    assert normalize_integer_answer("\\frac{1}{2}") == "\\frac{1}{2}"


def test_boxed_match():
    assert boxed_match("... so the answer is \\boxed{024}.", "24") == 1.0
    assert boxed_match("\\boxed{24} wait, no: \\boxed{25}", "24") == 0.0  # the last box counts
    assert boxed_match("The answer is 24.", "24") == 0.0  # unboxed answers do not count
    assert boxed_match("\\boxed{\\dfrac{3}{4}}", "24") == 0.0
