"""A small byte-level BPE tokenizer trained locally for the tiny models, plus their chat template.

Design:

* Byte-level: every string maps to tokens, and every printable ASCII string (any whitespace,
  digits, operators, punctuation) decodes back exactly. The only normaliser is NFC (see below),
  which leaves ASCII untouched.
* Digits and punctuation are one character per token: the vocabulary is trained with a
  pre-tokeniser that isolates every digit and every non-letter, non-space character, so no
  merge involving them exists and ``123`` is always ``1 2 3``; ``+-*/()=<>`` are one token
  each. Letter runs (with one optional leading space) and whitespace runs are BPE-merged.
* The vocabulary is trained in well under a second on a built-in corpus of English words and
  task-like sentences (:func:`build_corpus`), so no file is ever downloaded.
* Control tokens have the lowest ids (see :data:`SPECIAL_TOKENS`); ``<|im_start|>``,
  ``<|im_end|>``, ``<|endoftext|>``, bos and pad are *special* (dropped by
  ``skip_special_tokens``); the tool and think tags are single tokens that are *not* special,
  so a decoded response still shows its ``<tool_call>`` blocks.

The transformers 5 trap, and how it is avoided: ``AutoTokenizer`` picks a class from the
model config's ``model_type`` and model-specific classes rebuild the normaliser,
pre-tokeniser and decoder in ``__init__``, discarding those saved in ``tokenizer.json``. For
``qwen2`` it does so even when ``tokenizer_config.json`` names another class (qwen2 is in
``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`` and is forced to ``Qwen2Tokenizer``). So after
training, the tokenizer is given *exactly* the pipeline ``Qwen2Tokenizer`` imposes (read from
an instance of that class, not copied by hand): for qwen2 the forced rebuild is then a no-op,
and for the other architectures ``tokenizer_class`` is pinned to the generic
``TokenizersBackend``, which loads ``tokenizer.json`` as it is. Serving with the coarser Qwen
split keeps the digit/punctuation guarantee above: it only regroups pieces, and no learned
merge involves a digit or a punctuation character.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "SMOLVLM_CHAT_TEMPLATE",
    "SMOLVLM_IMAGE_TOKEN",
    "SMOLVLM_TOKENS",
    "VISION_TOKENS",
    "VLM_CHAT_TEMPLATE",
    "ENDOFTEXT_TOKEN",
    "EOS_TOKEN",
    "GENERIC_TOKENIZER_CLASS",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TAG_TOKENS",
    "TOKENIZER_VOCAB_SIZE",
    "build_corpus",
    "build_tokenizer",
    "save_tokenizer",
    "tokenizer_recipe_hash",
    "train_backend_tokenizer",
]

#: Qwen2-VL's vision tokens: an image or video sits between start and end as one pad token,
#: which the processor repeats once per merged patch.
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IMAGE_PAD_TOKEN = "<|image_pad|>"
VIDEO_PAD_TOKEN = "<|video_pad|>"
VISION_TOKENS: tuple[str, ...] = (
    VISION_START_TOKEN,
    VISION_END_TOKEN,
    IMAGE_PAD_TOKEN,
    VIDEO_PAD_TOKEN,
)

#: SmolVLM's (Idefics3's) vision tokens: ``<image>`` is both the placeholder and the token of
#: every image embedding; each image tile's run follows ``<fake_token_around_image>`` and a
#: ``<row_r_col_c>`` marker (``<global-img>`` for the downscaled whole image).
SMOLVLM_IMAGE_TOKEN = "<image>"
SMOLVLM_TOKENS: tuple[str, ...] = (
    "<fake_token_around_image>",
    SMOLVLM_IMAGE_TOKEN,
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)),
)

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# eos is the end of an assistant turn, as in Qwen instruct models: generation stops there.
EOS_TOKEN = IM_END_TOKEN

#: Tokens removed by ``decode(..., skip_special_tokens=True)``; ids 0.. in this order.
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN,
    BOS_TOKEN,
    ENDOFTEXT_TOKEN,
    IM_START_TOKEN,
    IM_END_TOKEN,
)
#: Single-token tags that stay visible after ``skip_special_tokens=True``; ids follow the above.
TAG_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

#: Target size of the trained vocabulary, control tokens included.
TOKENIZER_VOCAB_SIZE = 1024

#: The class name written to tokenizer_config.json; it keeps tokenizer.json's pipeline on load.
GENERIC_TOKENIZER_CLASS = "TokenizersBackend"

# Training split: letter runs keep one leading space (GPT-2 style); every digit and every other
# non-space character is a piece of its own, so BPE never learns a merge involving them.
_TRAIN_SPLIT_PATTERN = r" ?\p{L}+|\p{N}|[^\s\p{L}\p{N}]|\s+(?!\S)|\s+"

# Bumped whenever the corpus or the training pipeline changes, so cached models are rebuilt.
_RECIPE_VERSION = 1

_WORDS = """
a about above across act add added after again against age ago agree air all almost alone
along already also always am among amount an and angle animal another answer any anything
appear apple are area arm around arrive art as ask at away baby back bad ball bank base be
bear beat beautiful became because become bed been before began begin behind being believe
bell below best better between big bird bit black block blood blue board boat body bone book
both bottom box boy bread break bring brother brown build built burn busy but buy by call
came camp can capital captain car card care carry case cat catch caught cause cell center
certain chair chance change character charge chart check child children choose circle city
class clean clear climb clock close cloud coast cold collect color column come common
compare complete computer condition connect consider contain continue control cook cool
copy corn correct cost could count country course cover cow create cross crowd cry current
cut dance dark day dead deal dear decide decimal deep describe design determine develop
did die difference different difficult digit direct discuss distant divide division do
doctor does dog dollar done door double down draw dream dress drink drive drop dry during
each ear early earth east easy eat edge effect egg eight either electric element else end
enemy energy engine enough enter equal equation even evening event ever every exact example
except exercise expect experience experiment explain express eye face fact fair fall family
famous far farm fast father favor fear feel feet few field fig fight figure fill final find
fine finger finish fire first fish fit five floor flow flower fly follow food foot for
force forest form forward found four fraction free fresh friend from front fruit full fun
game garden gas gather gave general gentle get girl give glad glass go gold gone good got
govern grand grass gray great green grew ground group grow guess guide had hair half hand
happen happy hard has hat have he head hear heard heart heat heavy held help her here high
hill him his history hold hole home hope horse hot hour house how huge human hundred hunt
hurry i ice idea if important in inch include increase indicate industry information input
inside instead interest into iron is island it its job join joy jump just keep kept key
kill kind king knew know lady lake land language large last late laugh law lay lead learn
least leave left leg length less let letter level lie life lift light like line list listen
little live locate long look lost lot loud love low machine made main major make man many
map mark market mass master match material matter may me mean measure meat meet melody
member metal method middle might mile milk million mind minute miss modern molecule moment
money month moon more morning most mother motion mountain mouth move much multiply music
must my name nation natural nature near necessary neck need neighbor never new next night
nine no noise none noon nor north nose not note nothing notice noun now number numeral
object observe occur ocean of off offer office often oh oil old on once one only open
operation operator opposite or order organ original other our out output over own page
paint pair paper paragraph parent part party pass past path pattern pay people perhaps
period person phrase pick picture piece place plain plan plane planet plant play please
plural poem point poor populate port pose position possible post pound power practice
prepare present press pretty print probable problem process produce product proper
property protect prove provide pull push put question quick quiet quite quotient race radio
rain raise ran range rather reach read ready real reason receive record red region remain
remember repeat reply represent require rest result return reverse rich ride right ring
rise river road rock roll room root rope rose round row rule run safe said sail salt same
sand sat save saw say scale school science score sea search season seat second section see
seed seem segment select self sell send sense sent sentence separate serve set settle seven
several shall shape share sharp she shell shine ship shoe shop shore short should shoulder
shout show side sight sign silent silver similar simple since sing single sister sit six
size skill skin sky sleep slip slow small smell smile snow so soft soil soldier solution
solve some son song soon sound south space speak special speech speed spell spend spot
spread spring square stand star start state station stay stead steam steel step stick
still stone stood stop store story straight strange stream street string strong student
study subject substance subtract success such sudden suffix sugar suggest sum summer sun
supply support sure surface surprise swim syllable symbol system table tail take talk tall
teach team teeth tell temperature ten term test than thank that the their them then there
these they thick thin thing think third this those though thought thousand three through
throw thus tie time tiny tire to together told tone too took tool top total touch toward
town track trade train travel tree triangle trip trouble truck true try tube turn twenty
two type under unit until up upon us use usual valley value vary verb very view village
visit voice vowel wait walk wall want war warm was wash watch water wave way we wear
weather week weight well went were west what wheel when where whether which while white
who whole whose why wide wife wild will win wind window wing winter wire wish with woman
women wonder wood word work world would write written wrong wrote yard year yellow yes yet
you young your zero
"""

# Words the built-in tasks, tool calls and reasoning traces use; weighted up in the corpus.
_TASK_WORDS = """
answer arithmetic arguments assistant calculate calculator compute countdown equation
evaluate expression final function integer letters multiply name numbers operator
parentheses prompt reasoning result reverse reversed solution sort sorted step string
subtract sum system target think tool tools user value
"""

_TEMPLATES = (
    "What is {expr}?",
    "Compute {expr} and give the final answer.",
    "Evaluate the expression {expr} = ?",
    "Reverse the string {word}.",
    "Sort the letters of {word} in order.",
    "Using the numbers {nums}, make {target}. Use each number once.",
    "The answer is {target}.",
    "Let me think step by step. First, {expr} = {target}.",
    "So the final answer is {target}.",
    "Call the calculator tool with the expression {expr}.",
    '{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}',
    "The {word} is {target} and the {word2} is {target2}.",
)


def build_corpus(num_sentences: int = 2000, seed: int = 0) -> list[str]:
    """Return the deterministic built-in training corpus: words plus task-like sentences.

    Args:
        num_sentences: how many random sentences to generate on top of the word list.
        seed: seed of the sentence generator.
    """
    if num_sentences < 0:
        raise ValueError(f"num_sentences must be >= 0, got {num_sentences}")
    rng = random.Random(seed)
    words = _WORDS.split()
    task_words = _TASK_WORDS.split()
    vocab = words + task_words * 4
    lines: list[str] = []
    # Each word alone, leading-space form and capitalised, so every word gets a chance to merge.
    for w in words + task_words:
        lines.append(f"{w} {w.capitalize()} {w}.")

    def expr() -> str:
        parts = [str(rng.randint(0, 999))]
        for _ in range(rng.randint(1, 4)):
            parts.append(rng.choice("+-*/"))
            parts.append(str(rng.randint(0, 99)))
        text = " ".join(parts) if rng.random() < 0.5 else "".join(parts)
        return f"({text})" if rng.random() < 0.2 else text

    for _ in range(num_sentences):
        if rng.random() < 0.5:
            template = rng.choice(_TEMPLATES)
            nums = ", ".join(str(rng.randint(1, 100)) for _ in range(rng.randint(3, 6)))
            lines.append(
                template.format(
                    expr=expr(),
                    word=rng.choice(vocab),
                    word2=rng.choice(vocab),
                    nums=f"[{nums}]",
                    target=rng.randint(0, 1000),
                    target2=rng.randint(0, 1000),
                )
            )
        else:
            sentence = " ".join(rng.choice(vocab) for _ in range(rng.randint(4, 14)))
            lines.append(sentence.capitalize() + rng.choice(".?!:;,"))
    return lines


def tokenizer_recipe_hash(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> str:
    """Hash everything that determines the trained tokenizer (for cache checks)."""
    blob = json.dumps(
        {
            "version": _RECIPE_VERSION,
            "vocab_size": vocab_size,
            "split": _TRAIN_SPLIT_PATTERN,
            "pipeline": _imposed_pipeline_json(),
            "special": SPECIAL_TOKENS,
            "tags": TAG_TOKENS,
            "corpus": hashlib.sha256("\n".join(build_corpus()).encode()).hexdigest(),
            "template": hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _imposed_pipeline() -> tuple[Any, Any, Any]:
    """Return the (normalizer, pre_tokenizer, decoder) that ``Qwen2Tokenizer`` forces on load."""
    # Imported here: pulling in the qwen2 tokenizer module is only needed to build a tokenizer.
    from transformers import Qwen2Tokenizer

    backend = Qwen2Tokenizer().backend_tokenizer
    return backend.normalizer, backend.pre_tokenizer, backend.decoder


def _imposed_pipeline_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.normalizer, tok.pre_tokenizer, tok.decoder = _imposed_pipeline()
    data = json.loads(tok.to_str())
    return json.dumps({k: data[k] for k in ("normalizer", "pre_tokenizer", "decoder")})


@functools.lru_cache(maxsize=4)
def _trained_json(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_TRAIN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    control = [
        AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False)
        for t in SPECIAL_TOKENS + TAG_TOKENS
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=control,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    # Serve with the pipeline AutoTokenizer would impose anyway (see the module docstring).
    tok.normalizer, tok.pre_tokenizer, tok.decoder = _imposed_pipeline()
    # The trainer registers every control token as special; the tags are meant to survive
    # skip_special_tokens (a decoded response must keep its <tool_call> blocks).
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        if entry["content"] in TAG_TOKENS:
            entry["special"] = False
    return json.dumps(data, ensure_ascii=False)


def train_backend_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Tokenizer:
    """Train (or fetch from the in-process cache) the raw ``tokenizers.Tokenizer``.

    Args:
        vocab_size: target vocabulary size including the control tokens; at least 512 so the
            256 byte symbols and the control tokens fit with room for merges.
    """
    if not isinstance(vocab_size, int) or vocab_size < 512:
        raise ValueError(f"vocab_size must be an int >= 512, got {vocab_size!r}")
    return Tokenizer.from_str(_trained_json(vocab_size))


def build_tokenizer(
    vocab_size: int = TOKENIZER_VOCAB_SIZE,
    reserved_tokens: int = 0,
    model_max_length: int = 8192,
    vision: bool | str = False,
) -> PreTrainedTokenizerFast:
    """Build the tiny-model tokenizer as a Hugging Face fast tokenizer with the chat template.

    Args:
        vocab_size: target size of the trained vocabulary (control tokens included).
        reserved_tokens: extra special tokens ``<|reserved_0|>``... appended after the trained
            vocabulary, e.g. to give the model spare embedding rows that still decode.
        model_max_length: the longest sequence the tokenizer reports as supported.
        vision: add the Qwen2-VL vision tokens (:data:`VISION_TOKENS`, after the reserved ones)
            and use :data:`VLM_CHAT_TEMPLATE`, which renders ``{"type": "image"}`` and
            ``{"type": "video"}`` content parts as one placeholder each; ``"smolvlm"``: add
            :data:`SMOLVLM_TOKENS` and render an image part as ``<image>``
            (:data:`SMOLVLM_CHAT_TEMPLATE`).

    Returns:
        A tokenizer with ``padding_side="right"``, bos/eos/pad set and ``chat_template`` filled.
    """
    if not isinstance(reserved_tokens, int) or reserved_tokens < 0:
        raise ValueError(f"reserved_tokens must be an int >= 0, got {reserved_tokens!r}")
    backend = train_backend_tokenizer(vocab_size)
    reserved = [f"<|reserved_{i}|>" for i in range(reserved_tokens)]
    smolvlm = vision == "smolvlm"
    vision_tokens = SMOLVLM_TOKENS if smolvlm else VISION_TOKENS if vision else ()
    added = [*reserved, *vision_tokens]
    if added:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Qwen2Tokenizer (forced for qwen2 on load) defaults unk to <|endoftext|>; setting it
        # here keeps the special-token map identical for every architecture. Byte-level BPE
        # never emits unk.
        unk_token=ENDOFTEXT_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, *added],
        # Saved explicitly so it survives reload; trainers switch to left padding for prompts.
        padding_side="right",
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = (
        SMOLVLM_CHAT_TEMPLATE if smolvlm else VLM_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
    )
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> Path:
    """Save a tokenizer so that stock ``AutoTokenizer`` reloads it with the same pipeline.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` and pins
    ``tokenizer_class`` to :data:`GENERIC_TOKENIZER_CLASS` (see the module docstring for why).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    if cfg.get("tokenizer_class") != GENERIC_TOKENIZER_CLASS:
        cfg["tokenizer_class"] = GENERIC_TOKENIZER_CLASS
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


# Qwen-style ChatML. Kept prefix-stable on purpose: rendering messages[:k] is a string prefix
# of rendering messages[:k+1] (no look-ahead, no history rewriting such as dropping old
# <think> blocks, and each tool message is its own turn), so an agent loop can tokenise the
# new turns alone. Tool calls are rendered compactly for tiny models:
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>
# Every tag trims the whitespace around it, so the layout below never reaches the output.
CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('Only text content parts are supported, got type '
                    + part.type|string) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{%- set first_is_system = messages|length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_is_system -%}
        {{- render_content(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to help with the user query.\n\n'
        + 'You are provided with function signatures within <tools></tools> XML tags:\n'
        + '<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + tool|tojson -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with the function name'
        + ' and arguments within <tool_call></tool_call> XML tags:\n'
        + '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
        + '<|im_end|>\n' -}}
{%- elif first_is_system -%}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}

{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- '<|im_start|>system\n' + render_content(message.content) + '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' + render_content(message.content) + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- set ns = namespace(body='') -%}
        {%- if message.reasoning_content is defined and message.reasoning_content -%}
            {%- set ns.body = '<think>' + message.reasoning_content + '</think>' -%}
        {%- endif -%}
        {%- set ns.body = ns.body + render_content(message.content) -%}
        {{- ns.body -}}
        {%- if message.tool_calls is defined and message.tool_calls -%}
            {%- for tool_call in message.tool_calls -%}
                {%- if tool_call.function is defined -%}
                    {%- set call = tool_call.function -%}
                {%- else -%}
                    {%- set call = tool_call -%}
                {%- endif -%}
                {%- if ns.body or not loop.first -%}
                    {{- '\n' -}}
                {%- endif -%}
                {{- '<tool_call>{"name": ' + call.name|tojson + ', "arguments": ' -}}
                {%- if call.arguments is string -%}
                    {{- call.arguments -}}
                {%- else -%}
                    {{- call.arguments|tojson -}}
                {%- endif -%}
                {{- '}</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {{- '<|im_start|>tool\n<tool_response>' + render_content(message.content)
            + '</tool_response><|im_end|>\n' -}}
    {%- else -%}
        {{- raise_exception('Unknown message role ' + message.role|string
            + '; expected system, user, assistant or tool') -}}
    {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()


# The text template plus image and video parts (Qwen2-VL's layout): each part becomes
# <|vision_start|><|image_pad|><|vision_end|>, and the processor expands the pad token.
VLM_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    """            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}""",
    """            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part.type == 'image' or part.type == 'image_url' -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type == 'video' -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- else -%}""",
)
assert VLM_CHAT_TEMPLATE != CHAT_TEMPLATE

# The text template with SmolVLM's image part: one <image>, which the processor expands.
SMOLVLM_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    """            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}""",
    """            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part.type == 'image' or part.type == 'image_url' -%}
                {{- '<image>' -}}
            {%- else -%}""",
)
assert SMOLVLM_CHAT_TEMPLATE != CHAT_TEMPLATE
