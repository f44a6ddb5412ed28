"""A safe evaluator of integer arithmetic expressions (+ - * / and parentheses).

Used by the countdown scorer and by the calculator tool and environment of the agent loop:
a tokenizer and a recursive-descent parser over exact fractions, with limits on length,
nesting, literal size and intermediate values so that no input can exhaust the process.
"""

from __future__ import annotations

from fractions import Fraction

__all__ = ["ExpressionError", "evaluate_expression"]

#: Longest expression (characters) the countdown parser accepts.
MAX_EXPR_CHARS = 256
#: Deepest nesting of parentheses / unary minus accepted.
MAX_EXPR_DEPTH = 32
#: Most digits in one integer literal.
MAX_LITERAL_DIGITS = 12
#: Largest bit length of any intermediate numerator or denominator.
MAX_VALUE_BITS = 256

_OPERATOR_ALIASES = {"×": "*", "÷": "/", "−": "-"}


class ExpressionError(ValueError):
    """An expression that is malformed, uses disallowed tokens, or exceeds a safety limit."""


def _tokenize(text: str) -> list[tuple[str, int | None]]:
    tokens: list[tuple[str, int | None]] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch.isspace():
            i += 1
            continue
        if ch.isdigit() and ch.isascii():
            j = i
            while j < n and text[j].isdigit() and text[j].isascii():
                j += 1
            literal = text[i:j]
            if len(literal) > MAX_LITERAL_DIGITS:
                raise ExpressionError(
                    f"integer literal at position {i} has {len(literal)} digits; "
                    f"at most {MAX_LITERAL_DIGITS} are allowed"
                )
            tokens.append(("num", int(literal)))
            i = j
            continue
        op = _OPERATOR_ALIASES.get(ch, ch)
        if op in "+-*/()":
            tokens.append((op, None))
            i += 1
            continue
        raise ExpressionError(
            f"disallowed character {ch!r} at position {i}; only integers, + - * / and "
            "parentheses are allowed"
        )
    return tokens


class _Parser:
    """Recursive-descent parser that evaluates while parsing.

    Grammar: ``expr := term (('+'|'-') term)*``, ``term := factor (('*'|'/') factor)*``,
    ``factor := '-' factor | '(' expr ')' | INT``.
    """

    def __init__(self, tokens: list[tuple[str, int | None]]):
        self.tokens = tokens
        self.pos = 0
        self.numbers: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos][0] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, int | None]:
        tok = self.tokens[self.pos]
        self.pos += 1
        return tok

    def parse(self) -> Fraction:
        if not self.tokens:
            raise ExpressionError("empty expression")
        value = self.expr(0)
        if self.pos != len(self.tokens):
            raise ExpressionError(f"unexpected token {self.peek()!r} after a complete expression")
        return value

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()[0]
            rhs = self.term(depth)
            value = _checked(value + rhs if op == "+" else value - rhs)
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()[0]
            rhs = self.factor(depth)
            if op == "*":
                value = _checked(value * rhs)
            else:
                if rhs == 0:
                    raise ExpressionError("division by zero")
                value = _checked(value / rhs)
        return value

    def factor(self, depth: int) -> Fraction:
        if depth > MAX_EXPR_DEPTH:
            raise ExpressionError(f"expression nested deeper than {MAX_EXPR_DEPTH} levels")
        kind = self.peek()
        if kind is None:
            raise ExpressionError("expression ends where a number or '(' was expected")
        if kind == "-":
            self.take()
            return -self.factor(depth + 1)
        if kind == "(":
            self.take()
            value = self.expr(depth + 1)
            if self.peek() != ")":
                raise ExpressionError("missing closing parenthesis")
            self.take()
            return value
        if kind == "num":
            literal = self.take()[1]
            assert literal is not None
            self.numbers.append(literal)
            return Fraction(literal)
        raise ExpressionError(f"unexpected token {kind!r} where a number or '(' was expected")


def _checked(value: Fraction) -> Fraction:
    if (
        abs(value.numerator).bit_length() > MAX_VALUE_BITS
        or value.denominator.bit_length() > MAX_VALUE_BITS
    ):
        raise ExpressionError(f"intermediate result exceeds {MAX_VALUE_BITS} bits")
    return value


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
    """Safely evaluate an integer arithmetic expression with exact fractions.

    Only non-negative integer literals, ``+ - * /``, unary minus and parentheses are
    allowed (``×``, ``÷`` and ``−`` are read as ``*``, ``/`` and ``-``). Nothing is ever
    passed to ``eval``.

    Returns:
        The exact value and the integer literals in the order they appear.

    Raises:
        ExpressionError: For an empty or malformed expression, a disallowed character, a
            division by zero, or an expression over the length / depth / size limits.
    """
    if not isinstance(text, str):
        raise ExpressionError(f"expression must be a str, got {type(text).__name__}")
    if len(text) > MAX_EXPR_CHARS:
        raise ExpressionError(
            f"expression has {len(text)} characters; at most {MAX_EXPR_CHARS} are allowed"
        )
    parser = _Parser(_tokenize(text))
    return parser.parse(), parser.numbers
