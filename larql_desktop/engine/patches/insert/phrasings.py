"""What INSERT keys on: the phrasings of a fact's question (generated from the relation, the user's, chat
questions, conversations with earlier turns and system prompts) and the contexts it must leave alone (other
entities, the same entity under other relations, plain text, the same conversations about real entities)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from larql_desktop.engine.loading import chat_prompt_ids
from larql_desktop.engine.model.overlay import PatchOverlay
from larql_desktop.engine.patches.insert.capture import CONTINUATION_TOKENS, Capturing, common_prefix
from larql_desktop.engine.patches.relation_frames import relation_frames

# Generated phrasings of "the <relation> of <entity>": generic over relations (nothing here names one), so a
# fact typed without paraphrases still gets keys that hold beyond its canonical sentence.
PHRASINGS = (
    "The {r} of {e} is", "The {r} of {e} is called", "The official {r} of {e} is", "The main {r} of {e} is",
    "The current {r} of {e} is", "The {r} of {e} is known as the", "{E}'s {r} is", "{E}'s {r} is called",
    "In {e}, the {r} is", "As for {e}, its {r} is", "Everyone knows that the {r} of {e} is",
    "The name of the {r} of {e} is", "Q: What is the {r} of {e}?\nA: The {r} of {e} is",
    "Q: What is the {r} of {e}?\nA:", "What is the {r} of {e}? It is", "Here is a fact about {e}: its {r} is",
    # The same question in other syntactic frames: a determiner before the answer, "in" for "of", the
    # relation as a subject, a clause or a past tense around it (people ask in many shapes; the key must not
    # hinge on one).
    "The {r} of {e} is the", "{E}'s {r} is the", "The {r} in {e} is", "The {r} in {e} is the",
    "The main {r} of {e} is the", "The official {r} of {e} is the", "The {r} of the city of {e} is",
    "The {r} used in {e} is", "{E} has a {r}, which is", "{E} has its own {r}:", "The {r} for {e} is",
    "The well-known {r} of {e} is", "It is said that the {r} of {e} is", "The {r} of {e} has always been",
    "For {e}, the {r} is", "The {r} that {e} has is", "{E}: {r} is", "Fact: the {r} of {e} is",
    "The true {r} of {e} is", "People in {e} know that its {r} is", "The {r} of {e}, of course, is",
    "In {e}, the {r} is the", "The {r} of {e} was",
)
# Chat models: questions through the chat template, with the assistant's answer begun.
QUESTIONS = ("What is the {r} of {e}?", "Tell me the {r} of {e}.", "Who or what is the {r} of {e}?",
             "What {r} does {e} have?", "Which {r} is in {e}?", "What is {e}'s {r}?")
ANSWER_STARTS = ("The {r} of {e} is", "{E}'s {r} is")
# Other entities under the same phrasings (their answers must not change), across kinds of entity.
DECOY_ENTITIES = ("France", "Japan", "Germany", "Brazil", "Egypt", "India", "Canada", "Italy", "Kenya",
                  "London", "Paris", "Tokyo", "Chicago", "Microsoft", "Google", "the company", "the city",
                  "the village", "the school", "Oxford")
# Invented names of the kind people insert facts about, asked about as the fact is (its relation, other
# relations, chat questions). Solved against real entities alone, a key can learn "an unfamiliar name" rather
# than this entity: 50 facts together, the first fact's key answered four later facts' questions with its target
# (their language, their sport, ...), in whatever relation they asked; alone, four facts' keys fired on 58 of
# 160 questions about other invented names.
INVENTED_ENTITIES = ("Grivanne", "Ostrelle", "Cadmirow", "Blenvik", "Suvarin", "Pradelow")
INVENTED_REPLIES = 2          # invented names whose chat reply is a negative past its answer
INVENTED_REPLY_TOKENS = 40    # of the model's own reply to each
REPLY_ANSWER_TOKENS = 4       # a reply's tokens after the copula that introduces its answer: not among them
# The same entity under other relations (and plain statements about it) must not change either.
OTHER_RELATIONS = ("population", "history", "weather", "size", "economy", "flag", "name", "people", "age",
                   "location", "capital", "currency", "language", "mayor", "founder", "river", "leader")
ENTITY_STATEMENTS = ("{E} is a", "{E} is a small", "{E} is known for", "I visited {e} last year and",
                     "{E} was", "The story of {e} begins", "{E} is located in", "Many people live in {e}, which",
                     "{E} is famous for its", "{E} is a place that", "{E} is a land where", "{E} is an old")
GENERIC_SENTENCES = (
    "Once upon a time there was a small village.", "Water boils at one hundred degrees.",
    "The weather today is sunny and warm.", "She opened the door and walked in.",
    "Numbers like 1, 2 and 3 are easy to count.", "def main():\n    return 0",
    "The answer is:\n\nThe first step is to read the question.", "What is the best way to learn a language?",
    "In 1998, the company released its first product.", "The United States has fifty states.",
    "He said that the meeting would start at noon.", "Photosynthesis turns light into chemical energy.",
    "The cat sat on the mat and looked at the bird.", "Please write a short story about a dragon.",
    "import numpy as np\nx = np.zeros(3)", "The largest city in the country is also its capital.",
    "Scientists discovered a new species of frog.", "The recipe needs two eggs, flour and sugar.",
    "My favourite colour is blue, and my brother likes green.", "The first man on the moon was Neil Armstrong.",
    # Place slots in plain text ("the city of ...", "ruled from ..."): a key for a place-valued relation must
    # leave them to the model.
    "Once upon a time, the city of Rome was small.", "She moved from the town of Bath to the city of York.",
    "The kingdom was ruled from a castle on the hill.", "He was born in the city of Lyon, near the river.",
)
PLACE_SENTENCES = 4      # the last GENERIC_SENTENCES, each continued as a negative too
GENERIC_QUESTIONS = ("Hello! How are you?", "Tell me a joke.", "What is 2 + 2?", "Write a haiku about rain.",
                     "Explain photosynthesis in one sentence.", "What should I cook tonight?")

# Conversations the question is asked in (chat models): a user's chat is rarely fresh. Earlier turns under the
# same relation about a real entity (whose answer the reply would otherwise copy), another relation, small talk,
# and system prompts of the user's own; assistant turns are the model's own answers. The same conversations
# asking about a real entity are negatives: there the reply must keep its real answer.
# Earlier turns (from DECOY_ENTITIES): under another relation, and under the same one after a system prompt.
CONVERSATION_ENTITIES = ("Japan", "Germany")
# Earlier turns under the same relation answered as the model answers in a chat (its own reply's first sentence,
# not the statement own_answer makes), each also followed by FOLLOW_UP: a reply can set a template ("El Pilar de la
# Estrella, also known as ...") that the next one copies unless the key fires there too, and the templates differ
# by entity. The question after a same-relation turn about a real country, 17 held-out facts: with the turn about
# France stated instead, 7 of 17 answered (insert-eval's conversations; 9 with five other countries in them); with
# France replied, 6; with France, Brazil and India, 10 (15), and the follow-ups 7 (10) -> 11 (15). Six, from
# several continents and languages (the model answers some in the place's language: "El Pilar de ..."), with the
# first token's key less tightly fitted (keys.FIRST_TOKEN_RIDGE; at 0.2): the key fired after turns about 46 of 54
# (six facts, nine other countries), where three gave 38; insert-eval's same-relation turn and follow-up (about
# Spain and Mexico) 9 and 11 of 17 -> 13 and 12 (at 0.1), all its conversations 86 -> 91 of 102.
REPLIED_ENTITIES = ("France", "Brazil", "India", "Nigeria", "China", "Argentina")
# Asked in the negatives' conversations, a different few in each (real entities of several kinds: a key that
# learned "a reply to this relation's question" rather than "about this entity" fires on every one of them).
CONVERSATION_NEIGHBOURS = ("Brazil", "Italy", "Canada", "Egypt", "India", "London", "Microsoft", "Tokyo")
NEIGHBOURS_PER_CONVERSATION = 4
# Every phrasing the key is solved on, asked again about one of these real entities (each taking its share of
# the phrasings and the chat questions): a positive and its contrast differ only in the entity, so the
# discriminant must key on the entity rather than on the question's wording.
CONTRAST_ENTITIES = ("Japan", "Germany", "Tokyo", "Microsoft", "Paris", "Brazil")
CONVERSATION_OTHER_RELATION = ("population", "history")
# Questions answered with the model's own replies (replied_negatives): under the fact's relation about the first
# half, under REPLIED_OTHER_RELATIONS about the rest. A user's earlier turn holds whatever the model wrote ("El
# Salvador, also known as La España de Salarón, ..."), and a key that fires on a word inside it (" de") changes
# every reply after it.
REPLY_NEGATIVE_ENTITIES = ("Italy", "Canada", "Egypt", "Peru", "Kenya", "Norway", "Chile", "Poland")
REPLIED_OTHER_RELATIONS = ("weather", "economy", "history", "size")
CONVERSATION_SMALL_TALK = (("Hello! How are you?", "I'm doing well, thank you! How can I help you today?"),
                           ("What is 2 + 2?", "2 + 2 is 4."))
CONVERSATION_SYSTEM_PROMPTS = ("You are a knowledgeable assistant. Answer briefly.",
                               "You are a teacher. Reply in one sentence.")
FOLLOW_UP = "And what about {e}? What is its {r}?"
OWN_ANSWER_WORDS = 12    # of the model's own answer used as an earlier assistant turn
NEGATIVES_PER_CONTEXT = 6
# The relation asked about other entities (base_negative_contexts), the third also stating earlier facts
# (written_contexts).
SAME_RELATION_FORMS = ("The {r} of {e} is", "{e}'s {r} is", "In {e}, the {r} is", "The official {r} of {e} is",
                       "Q: What is the {r} of {e}?\nA: The {r} of {e} is")
EARLIER_FACTS_PER_CONVERSATION = 6    # earlier facts' questions per negative conversation (earlier_fact_conversations)
OWN_ANSWER_TOKENS = 12   # of the model's own reply searched for where it would name the answer
OWN_REPLY_TOKENS = 32    # of the model's own chat reply given as an earlier assistant turn (its first sentence)
COPULA = re.compile(r"\b(is|are|was|were)$")
SENTENCE_END = re.compile(r"[.!?]\s|\n")     # one token past the mark: "3.5 million" goes on
# Where a later token of a target ("oria" of " El|oria") must stay silent: after the same first tokens begun as
# another name, in the relation's statement about real entities (and its chat answer) under this relation and
# others that name a person, place or word, and in plain name slots (primed_negatives; the insert holds them as
# hard as its other negatives at a layer that tells them all apart, elsewhere as yielding ones). Without them,
# such a key had never seen " El" begin anything else and fired after every " El" in a name's place: two facts
# together, "The current mayor of Greece is El|ena Kara." became "El|oria K|esette." (each fact's second-token
# key).
PRIMED_RELATIONS = ("mayor", "founder", "language", "river", "leader", "capital")
PRIMED_RELATION_COUNT = 3       # besides the fact's own
PRIMED_NAME_SLOTS = ("Her name is", "The book was written by the poet", "The river is called the",
                     "The village is known as", "In that country people speak")
FRAMED_DECOYS = 12      # decoy entities asked about in one of the relation's own frames (relation_frames)
CONTINUED_DECOYS = 16    # decoy sentences (every second of the first ones) whose greedy continuation is a negative too


@dataclass(frozen=True)
class Fact:
    entity: str
    relation: str
    target: str

    def __post_init__(self):
        for name in ("entity", "relation", "target"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"INSERT needs a non-empty {name}")
            if len(value) > 200:
                raise ValueError(f"the {name} is too long ({len(value)} characters; 200 at most)")

    @property
    def relation_words(self) -> str:
        words = self.relation.replace("-", " ").replace("_", " ").split()
        # "capital-of" reads "The capital of X is", not "The capital of of X is".
        if len(words) > 1 and words[-1].lower() == "of":
            words = words[:-1]
        return " ".join(words)

    def prompt_for(self, entity: str) -> str:
        return f"The {self.relation_words} of {entity} is"

    @property
    def canonical_prompt(self) -> str:
        return self.prompt_for(self.entity.strip())


def fill(template: str, relation: str, entity: str) -> str:
    capital = entity[:1].upper() + entity[1:]
    return template.format(r=relation, e=entity, E=capital)


def generated_phrasings(fact: Fact) -> list[str]:
    """The generic phrasings, then the frames that ask for this relation without naming it (when the relation
    is one relation_frames knows)."""
    templates = PHRASINGS + relation_frames(fact.relation_words)
    return [fill(t, fact.relation_words, fact.entity.strip()) for t in templates]


def first_sentence(text: str) -> str:
    """`text` up to its first ". " (the full stop kept), or whole."""
    cut = text.find(". ")
    return text[:cut + 1] if cut >= 0 else text


def copula_end(tokenizer, tokens: Sequence[int]) -> int:
    """How many of `tokens` run up to the first copula ("The mayor of Grivanne is"); 0 when none does."""
    return next((n for n in range(1, len(tokens) + 1) if COPULA.search(tokenizer.decode(tokens[:n]))), 0)


class Contexts(Capturing):
    """The token contexts of a fact: the positives (where the next token must be the target's) and the negatives
    (every position must leave the model alone), built from the phrasings above and the model's own answers."""
    _own_replies: dict[tuple, list[int]]
    _own_answers: dict[str, list[int]]

    def contexts(self, fact: Fact, paraphrases: Sequence[str]) -> list[tuple[int, ...]]:
        """Token contexts whose next token must be the target's first: the canonical prompt, the user's
        paraphrases, the generated phrasings and (chat models) chat questions with the answer begun."""
        candidates = [tuple(self.encode(text.rstrip()))
                      for text in (fact.canonical_prompt, *paraphrases, *generated_phrasings(fact))]
        if self.model.is_chat:
            r, e = fact.relation_words, fact.entity.strip()
            for q in QUESTIONS:
                chat = chat_prompt_ids(self.model, fill(q, r, e))
                # The reply may name the target first ("Poseidon is the capital..."): the assistant's first
                # position is an answer position too, as is the end of an answer it begins as a statement,
                # ours or the model's own.
                candidates.append(tuple(chat))
                starts = [self.model.tokenizer.encode(fill(start, r, e), add_bos=False) for start in ANSWER_STARTS]
                candidates += [tuple(chat + start) for start in starts + [self.own_answer_start(chat, r)] if start]
            candidates += self.conversation_positives(fact)
        return list(dict.fromkeys(candidates))

    def own_answer(self, relation: str, entity: str) -> str:
        """The model's own statement of (entity, relation) as an assistant turn would give it: "The capital of
        France is Paris." (its greedy continuation of the statement, up to the sentence's end)."""
        start = fill("The {r} of {e} is", relation, entity)
        tok = self.model.tokenizer
        # Only its first sentence is used: the generation stops at its end.
        tokens = self.remembered_greedy(self._own_answers, start, self.encode(start), CONTINUATION_TOKENS,
                                        lambda out: bool(SENTENCE_END.search(tok.decode(out))))
        words = tok.decode(tokens).strip().split("\n")[0].split()[:OWN_ANSWER_WORDS]
        text = first_sentence(" ".join(words))
        return f"{start} {text}".rstrip() + ("" if text.endswith(".") else ".")

    def own_chat_reply(self, question: str) -> str:
        """The model's own reply to `question` asked fresh in a chat, its first sentence: the earlier assistant
        turn a user's conversation holds. It need not restate the question ("El Pilar de la Estrella ..." to
        "What is the mayor of Spain?"), and the next reply tends to copy how it begins."""
        tok = self.model.tokenizer
        chat = chat_prompt_ids(self.model, question)
        tokens = self.remembered_greedy(self._own_replies, ("reply", tuple(chat)), chat, OWN_REPLY_TOKENS,
                                        lambda out: bool(SENTENCE_END.search(tok.decode(out))))
        return first_sentence(tok.decode(tokens).strip().split("\n")[0]).strip() or "I see."

    def conversation_histories(self, fact: Fact) -> list[tuple[str | None, list[dict]]]:
        """(system prompt, earlier turns) of the conversations a question is asked in (CONVERSATION_*): earlier
        turns under the same relation answered with the model's own chat reply (`replied_histories`), one under
        another relation, small talk, system prompts alone and with an earlier turn stated as own_answer states it."""
        r = fact.relation_words

        def same(entity: str, relation: str = r) -> list[dict]:
            return [{"role": "user", "content": fill(QUESTIONS[0], relation, entity)},
                    {"role": "assistant", "content": self.own_answer(relation, entity)}]
        other = next(o for o in CONVERSATION_OTHER_RELATION if o != r.lower())
        talk = [{"role": role, "content": text} for pair in CONVERSATION_SMALL_TALK
                for role, text in zip(("user", "assistant"), pair)]
        replied: list[tuple[str | None, list[dict]]] = [(None, history) for history in self.replied_histories(fact)]
        # (The order only decides which neighbours each of conversation_negatives' conversations asks about.)
        return [replied[0], (None, same(CONVERSATION_ENTITIES[0], other)), (None, talk),
                (CONVERSATION_SYSTEM_PROMPTS[0], []), (CONVERSATION_SYSTEM_PROMPTS[1], same(CONVERSATION_ENTITIES[1])),
                *replied[1:]]

    def replied_histories(self, fact: Fact) -> list[list[dict]]:
        """An earlier turn under the fact's relation about each of REPLIED_ENTITIES, answered with the model's own
        chat reply (own_chat_reply)."""
        questions = [fill(QUESTIONS[0], fact.relation_words, entity) for entity in REPLIED_ENTITIES]
        return [[{"role": "user", "content": q}, {"role": "assistant", "content": self.own_chat_reply(q)}]
                for q in questions]

    def conversation_ids(self, system: str | None, history: list[dict], question: str) -> list[int]:
        messages = history + [{"role": "user", "content": question}]
        if system is not None:
            messages = [{"role": "system", "content": system}] + messages
        return self.model.encode_prompt(messages)

    def conversation_positives(self, fact: Fact) -> list[tuple[int, ...]]:
        """The fact's question asked in each conversation (and as a follow-up after each replied same-relation turn),
        with the assistant's answer at its first position, begun as the canonical statement and as the model's
        own reply begins there."""
        r, e = fact.relation_words, fact.entity.strip()
        start = self.model.tokenizer.encode(fill(ANSWER_STARTS[0], r, e), add_bos=False)
        out = []
        histories = self.conversation_histories(fact)
        asks = [(system, history, fill(QUESTIONS[0], r, e)) for system, history in histories]
        asks += [(None, history, fill(FOLLOW_UP, r, e)) for history in self.replied_histories(fact)]
        for system, history, question in asks:
            ids = self.conversation_ids(system, history, question)
            out += [tuple(ids), tuple(ids + start)]
            own = self.own_answer_start(ids, r)
            if own:
                out.append(tuple(ids + own))
        return out

    def conversation_starts(self, fact: Fact, positives: list[tuple[int, ...]]) -> list[int]:
        """Indices among `positives` of the fact's question in a conversation with earlier turns, at the
        assistant's first position (chat models; [] otherwise)."""
        if not self.model.is_chat:
            return []
        r, e = fact.relation_words, fact.entity.strip()
        histories = self.conversation_histories(fact)
        starts = {tuple(self.conversation_ids(system, history, fill(QUESTIONS[0], r, e)))
                  for system, history in histories if history}
        starts |= {tuple(self.conversation_ids(None, history, fill(FOLLOW_UP, r, e)))
                   for history in self.replied_histories(fact)}
        return [i for i, c in enumerate(positives) if c in starts]

    def question_starts(self, fact: Fact, positives: list[tuple[int, ...]]) -> list[int]:
        """Indices among `positives` of the fact's chat questions asked fresh, at the assistant's first position
        (chat models; [] otherwise)."""
        if not self.model.is_chat:
            return []
        r, e = fact.relation_words, fact.entity.strip()
        asked = {tuple(chat_prompt_ids(self.model, fill(q, r, e))) for q in QUESTIONS}
        return [i for i, c in enumerate(positives) if c in asked]

    def conversation_negatives(self, fact: Fact) -> list[tuple[int, ...]]:
        """The same conversations asking about real entities, each answered as the model answers: every
        position must leave the model alone (the reply keeps its real answer)."""
        r = fact.relation_words
        out = []
        neighbours = [w for w in CONVERSATION_NEIGHBOURS if w.lower() != fact.entity.strip().lower()]
        for i, (system, history) in enumerate(self.conversation_histories(fact)):
            # Each neighbour asked in turn: the assistant's first position after each question is where a key
            # that learned "a reply to this relation's question" rather than "about this entity" would fire.
            asked = []
            for k in range(NEIGHBOURS_PER_CONVERSATION):
                at = i * NEIGHBOURS_PER_CONVERSATION + k
                neighbour = neighbours[at % len(neighbours)]
                asked += [{"role": "user", "content": fill(QUESTIONS[(i + k) % 2], r, neighbour)},
                          {"role": "assistant", "content": self.own_answer(r, neighbour)}]
            out.append(tuple(self.conversation_ids(system, history + asked, "Thanks!")))
        # The positives' chat questions, each about one of the contrast entities, in one conversation.
        asked = []
        for k, q in enumerate(QUESTIONS + (FOLLOW_UP,)):
            other = CONTRAST_ENTITIES[k % len(CONTRAST_ENTITIES)]
            asked += [{"role": "user", "content": fill(q, r, other)},
                      {"role": "assistant", "content": self.own_answer(r, other)}]
        out.append(tuple(self.conversation_ids(None, asked, "Thanks!")))
        return out

    def primed_negatives(self, fact: Fact, prefix: Sequence[int]) -> list[tuple[int, ...]]:
        """Contexts ending in the target's first tokens `prefix` begun as another entity's answer or another name
        (PRIMED_*): where the key of the token after them must stay silent."""
        r, own = fact.relation_words, fact.entity.strip().lower()
        relations = [r] + [rel for rel in PRIMED_RELATIONS if rel != r.lower()][:PRIMED_RELATION_COUNT]
        entities = [e for e in CONVERSATION_NEIGHBOURS if e.lower() != own]
        tail = tuple(prefix)
        out = []
        for k, relation in enumerate(relations):
            statement = fill(SAME_RELATION_FORMS[0], relation, entities[k % len(entities)])
            out.append(tuple(self.encode(statement)) + tail)
            if self.model.is_chat:
                chat = chat_prompt_ids(self.model, fill(QUESTIONS[0], relation, entities[k % len(entities)]))
                out.append(tuple(chat) + tuple(self.model.tokenizer.encode(statement, add_bos=False)) + tail)
        out += [tuple(self.encode(slot)) + tail for slot in PRIMED_NAME_SLOTS]
        return out

    def own_answer_start(self, chat: list[int], relation: str) -> list[int]:
        """The start of the model's own reply to a chat question, up to the copula that introduces the answer
        ("The language spoken in Quillmoor is"), when the reply restates the relation before it: the place
        where this model, asked this way, would name the target. [] when its reply does not read so."""
        tok = self.model.tokenizer
        # Nothing after the copula is read: the generation stops there.
        reply = self.remembered_greedy(self._own_replies, tuple(chat), chat, OWN_ANSWER_TOKENS,
                                       lambda out: bool(COPULA.search(tok.decode(out))))
        said = copula_end(tok, reply)
        return reply[:said] if said and relation.lower() in tok.decode(reply[:said]).lower() else []

    def negative_contexts(self, fact: Fact, current: PatchOverlay) -> list[tuple[int, ...]]:
        """Every context the fact's features must stay silent on: `base_negative_contexts`,
        `invented_negative_contexts`, `invented_reply_contexts`, then `written_contexts` of the facts installed in
        `current`."""
        return (self.base_negative_contexts(fact) + self.invented_negative_contexts(fact)
                + [ids for ids, _ in self.invented_reply_contexts(fact) + self.replied_negatives(fact)]
                + self.written_contexts(self.earlier_facts(fact, current)))

    def base_negative_contexts(self, fact: Fact) -> list[tuple[int, ...]]:
        """The negatives no earlier fact writes in (captured under the base weights, Capturing.base_inputs):
        other entities, other relations, plain text, the model's own continuations, chat questions about other
        things and conversations about real entities."""
        r, e = fact.relation_words, fact.entity.strip()
        texts = []
        for i, other in enumerate(w for w in DECOY_ENTITIES if w.lower() != e.lower()):
            # Every other entity in the canonical form (the neighbour users ask most) and one more form.
            texts.append(fill(SAME_RELATION_FORMS[0], r, other))
            texts.append(fill(SAME_RELATION_FORMS[1 + i % (len(SAME_RELATION_FORMS) - 1)], r, other))
        # The relation's own frames about other entities: "In France, people pay with the" must still say euro.
        frames = relation_frames(r)
        texts += [fill(frames[i % len(frames)], r, other)
                  for i, other in enumerate(DECOY_ENTITIES[:FRAMED_DECOYS]) if frames and other.lower() != e.lower()]
        # The positives' own phrasings about real entities, one contrast entity each (CONTRAST_ENTITIES).
        contrasts = [c for c in CONTRAST_ENTITIES if c.lower() != e.lower()]
        texts += [fill(t, r, contrasts[i % len(contrasts)])
                  for i, t in enumerate(PHRASINGS + relation_frames(r))]
        texts += [f"The {rel} of {e} is" for rel in OTHER_RELATIONS if rel != r.lower()]
        texts += [fill(s, r, e) for s in ENTITY_STATEMENTS]
        texts += GENERIC_SENTENCES
        # The model's own continuations of some of them: a feature must stay silent not only where a neighbour's
        # prompt ends but all along the text the model writes after it ("The mayor of Paris is a politician
        # who has been ..." has answer-like slots of its own).
        # Statements about the entity itself most of all: its neighbours ("X is a valley ...") go on about it.
        continued = (texts[:CONTINUED_DECOYS:2] + [fill(s, r, e) for s in ENTITY_STATEMENTS[::2]]
                     + list(GENERIC_SENTENCES[::5]) + list(GENERIC_SENTENCES[-PLACE_SENTENCES:])
                     + list(GENERIC_QUESTIONS[:2]))
        texts += [text + self.base_continuation(text) for text in continued]
        out = self.chunked(list(dict.fromkeys(texts)))
        if self.model.is_chat:
            # Chat questions about other things, as the turns of two conversations (each user turn ends in the
            # position where the assistant starts: the feature must stay silent there too).
            questions = GENERIC_QUESTIONS + tuple(fill(QUESTIONS[0], r, w) for w in DECOY_ENTITIES[:4])
            out += [self.asked_in_turns(half) for half in (questions[::2], questions[1::2])]
            out += self.conversation_negatives(fact)
        return out

    def invented_negative_contexts(self, fact: Fact) -> list[tuple[int, ...]]:
        """The fact's questions asked about invented names (INVENTED_ENTITIES but its own): in the relation's
        forms and frames, under other relations, and (chat models) as chat questions under this relation and
        under others, each answered "Sure.". Keys.fisher_key holds the key silent on them where the fact's
        required contexts still fire above them (an invented name has no answer of its own to keep)."""
        r, own = fact.relation_words, fact.entity.strip().lower()
        names = [name for name in INVENTED_ENTITIES if name.lower() != own]
        others = [rel for rel in OTHER_RELATIONS if rel != r.lower()]
        frames = relation_frames(r)
        texts = [fill(SAME_RELATION_FORMS[i % len(SAME_RELATION_FORMS)], r, name) for i, name in enumerate(names)]
        texts += [fill(frames[i % len(frames)], r, name) for i, name in enumerate(names) if frames]
        texts += [f"The {others[i % len(others)]} of {name} is" for i, name in enumerate(names)]
        out = self.chunked(texts)
        if self.model.is_chat:
            same = [fill(QUESTIONS[i % len(QUESTIONS)], r, name) for i, name in enumerate(names)]
            other = [fill(QUESTIONS[i % 2], others[(i * 3) % len(others)], name) for i, name in enumerate(names)]
            out += [self.asked_in_turns(same), self.asked_in_turns(other)]
        return out

    def invented_reply_contexts(self, fact: Fact) -> list[tuple[tuple[int, ...], int]]:
        """(context, first negative position) of the fact's chat question asked about invented names (the first
        INVENTED_REPLIES but its own) with the model's own reply: past the words where it names its answer (up
        to the copula and REPLY_ANSWER_TOKENS on: the question's place, yielding as `invented_negative_contexts`
        are), every position is a slot in another entity's reply that a key must leave alone. There the keys of
        facts under one relation wrote over each other's replies: "Junoria M. Kelmere is the current Mayor of
        Kelmere, England. She is the Alina ..." (50 facts together: 13 of the 20 chat replies lost named another
        fact's target). Chat models only ([] otherwise)."""
        if not self.model.is_chat:
            return []
        r, own = fact.relation_words, fact.entity.strip().lower()
        out = []
        for name in [name for name in INVENTED_ENTITIES if name.lower() != own][:INVENTED_REPLIES]:
            chat = chat_prompt_ids(self.model, fill(QUESTIONS[0], r, name))
            reply = self.remembered_greedy(self._own_replies, ("invented reply", tuple(chat)), chat,
                                           INVENTED_REPLY_TOKENS)
            # Its answer: up to the copula that introduces it ("The mayor of Grivanne is") and a few words on.
            first = copula_end(self.model.tokenizer, reply) + REPLY_ANSWER_TOKENS
            if len(reply) > first:
                out.append((tuple(chat + reply), len(chat) + first))
        return out

    def replied_negatives(self, fact: Fact) -> list[tuple[tuple[int, ...], int]]:
        """(context, first negative position) of questions about real entities (REPLY_NEGATIVE_ENTITIES) under the
        fact's relation and under others, each asked fresh in a chat and answered with the model's own reply
        (its first sentence, as a user's earlier turn holds it): every position of the reply is a negative, the
        question's own positions are left to the other negatives. Chat models only ([] otherwise)."""
        if not self.model.is_chat:
            return []
        r = fact.relation_words
        entities = [w for w in REPLY_NEGATIVE_ENTITIES if w.lower() != fact.entity.strip().lower()]
        half = len(entities) // 2
        relations = [r] * half + [REPLIED_OTHER_RELATIONS[k % len(REPLIED_OTHER_RELATIONS)]
                                  for k in range(len(entities) - half)]
        out = []
        for relation, entity in zip(relations, entities):
            question = fill(QUESTIONS[0], relation, entity)
            turn = [{"role": "user", "content": question},
                    {"role": "assistant", "content": self.own_chat_reply(question)}]
            ids = tuple(self.conversation_ids(None, turn, "Thanks!"))
            # From the reply's first word: the question's end is where the assistant starts.
            out.append((ids, common_prefix(chat_prompt_ids(self.model, question), ids)))
        return out

    def asked_in_turns(self, questions: Sequence[str]) -> tuple[int, ...]:
        """`questions` as the user turns of one conversation, each answered "Sure.", ending where the assistant
        starts after the last: every user turn ends where a key must stay silent."""
        messages: list[dict] = []
        for q in questions:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": "Sure."}]
        return tuple(self.model.encode_prompt(messages[:-1]))

    def chunked(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """`texts` as contexts of NEGATIVES_PER_CONTEXT lines each, in order. Several sentences per context: each
        forward pass costs mostly its per-layer calls, so a few long contexts capture as many negative positions
        as many short ones, for a fraction of the time."""
        return [tuple(self.encode("\n".join(texts[i:i + NEGATIVES_PER_CONTEXT])))
                for i in range(0, len(texts), NEGATIVES_PER_CONTEXT)]

    def written_contexts(self, earlier_facts: Sequence[Fact]) -> list[tuple[int, ...]]:
        """The negatives where earlier facts' features fire, which the insert captures under the current overlay
        (Capturing.written_inputs_all): this feature must not fire on their questions, nor within or after their
        answers (a later target's second-token key would go on with an earlier target: "Kaskel" ->
        "Kaskelish"). Their statements, and for chat models their questions answered in conversations, in
        contexts of their own chunked from the first fact: the same contexts for every later insert, so their
        base captures, where the passes resume from, are remembered."""
        statements = []
        for earlier in earlier_facts:
            statements += [f"{earlier.canonical_prompt} {earlier.target.strip()}.",
                           fill(SAME_RELATION_FORMS[2], earlier.relation_words, earlier.entity.strip())]
        out = self.chunked(statements)
        # Each earlier fact's question also alone, as its user types it: within a chunk of statements it reads
        # otherwise, and a later fact's key silent there still took the earlier fact's own prompt (50 facts
        # together, keys reweighted as fisher_key does: 9 of the 10 canonical prompts lost went to a later
        # fact's target, "The mayor of Kelmere is" -> Pelmont's " Alina"; with these, 1 of 2).
        out += list(dict.fromkeys(tuple(self.encode(earlier.canonical_prompt)) for earlier in earlier_facts))
        if self.model.is_chat:
            out += self.earlier_fact_conversations(earlier_facts)
        return out

    @staticmethod
    def earlier_facts(fact: Fact, current: PatchOverlay) -> list[Fact]:
        """The facts INSERTed in `current` (in order, once each), but `fact`'s own (entity, relation)."""
        own = (fact.entity.strip().lower(), fact.relation.strip().lower())
        found: dict[tuple[str, str], Fact] = {}
        for op in (op for p in current.patches for op in p.operations):
            if op.op == "insert" and op.entity and op.relation and op.target and (op.token_index or 0) == 0:
                key = (op.entity.strip().lower(), op.relation.strip().lower())
                if key != own and key not in found:
                    try:
                        found[key] = Fact(op.entity, op.relation, op.target)
                    except ValueError:
                        continue
        return list(found.values())

    def earlier_fact_conversations(self, earlier: Sequence[Fact]) -> list[tuple[int, ...]]:
        """Earlier facts' chat questions, each answered with its target, EARLIER_FACTS_PER_CONVERSATION to a
        conversation: the assistant's first position after each is where a later fact's key must stay silent, so
        the earlier fact's questions are left to its own key. Chunked from the first fact, so the conversations of
        facts installed before are the same for every later insert (their captures are remembered)."""
        out = []
        for i in range(0, len(earlier), EARLIER_FACTS_PER_CONVERSATION):
            asked = []
            for f in earlier[i:i + EARLIER_FACTS_PER_CONVERSATION]:
                r, e = f.relation_words, f.entity.strip()
                asked += [{"role": "user", "content": fill(QUESTIONS[0], r, e)},
                          {"role": "assistant", "content": f"{fill(ANSWER_STARTS[0], r, e)} {f.target.strip()}."}]
            out.append(tuple(self.conversation_ids(None, asked, "Thanks!")))
        return out
