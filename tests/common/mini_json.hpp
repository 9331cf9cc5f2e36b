#pragma once
// A small strict JSON parser for tests (RFC 8259 values; numbers as double). Throws
// std::runtime_error naming the byte offset of the first error.
#include <cctype>
#include <cstddef>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace mini_json {

struct value {
  enum class kind { null, boolean, number, string, array, object };
  kind k = kind::null;
  bool b = false;
  double n = 0;
  std::string s;
  std::vector<value> items;       // array elements, or object values
  std::vector<std::string> keys;  // object keys (parallel to items)

  [[nodiscard]] bool is_object() const { return k == kind::object; }
  [[nodiscard]] bool is_array() const { return k == kind::array; }
  // Member `key` of an object, or null.
  [[nodiscard]] const value* find(std::string_view key) const {
    if (k != kind::object) return nullptr;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] == key) return &items[i];
    }
    return nullptr;
  }
  [[nodiscard]] std::string str(std::string_view key) const {
    const value* v = find(key);
    return v && v->k == kind::string ? v->s : std::string();
  }
  [[nodiscard]] double num(std::string_view key, double fallback = -1e300) const {
    const value* v = find(key);
    return v && v->k == kind::number ? v->n : fallback;
  }
};

class parser {
 public:
  explicit parser(std::string_view text) : t_(text) {}
  value parse() {
    value v = parse_value();
    skip_ws();
    if (p_ != t_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("JSON: " + what + " at offset " + std::to_string(p_));
  }
  void skip_ws() {
    while (p_ < t_.size() && (t_[p_] == ' ' || t_[p_] == '\n' || t_[p_] == '\r' || t_[p_] == '\t')) ++p_;
  }
  char peek() {
    skip_ws();
    if (p_ >= t_.size()) fail("unexpected end");
    return t_[p_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++p_;
  }
  void literal(std::string_view w) {
    if (t_.substr(p_, w.size()) != w) fail("bad literal");
    p_ += w.size();
  }
  value parse_value() {
    value v;
    const char c = peek();
    if (c == '{') {
      v.k = value::kind::object;
      ++p_;
      if (peek() == '}') {
        ++p_;
        return v;
      }
      for (;;) {
        if (peek() != '"') fail("expected a key");
        v.keys.push_back(parse_string());
        expect(':');
        v.items.push_back(parse_value());
        if (peek() == ',') {
          ++p_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.k = value::kind::array;
      ++p_;
      if (peek() == ']') {
        ++p_;
        return v;
      }
      for (;;) {
        v.items.push_back(parse_value());
        if (peek() == ',') {
          ++p_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.k = value::kind::string;
      v.s = parse_string();
      return v;
    }
    if (c == 't') {
      literal("true");
      v.k = value::kind::boolean;
      v.b = true;
      return v;
    }
    if (c == 'f') {
      literal("false");
      v.k = value::kind::boolean;
      return v;
    }
    if (c == 'n') {
      literal("null");
      return v;
    }
    return parse_number();
  }
  std::string parse_string() {
    expect('"');
    std::string out;
    for (;;) {
      if (p_ >= t_.size()) fail("unterminated string");
      const char c = t_[p_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (p_ >= t_.size()) fail("unterminated escape");
      const char e = t_[p_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (p_ + 4 > t_.size()) fail("short \\u escape");
          for (int i = 0; i < 4; ++i) {
            const char h = t_[p_ + static_cast<std::size_t>(i)];
            if (!std::isxdigit(static_cast<unsigned char>(h))) fail("bad \\u escape");
          }
          out += '?';
          p_ += 4;
          break;
        }
        default: fail("bad escape");
      }
    }
  }
  value parse_number() {
    const std::size_t start = p_;
    if (p_ < t_.size() && t_[p_] == '-') ++p_;
    auto digits = [&] {
      const std::size_t d = p_;
      while (p_ < t_.size() && t_[p_] >= '0' && t_[p_] <= '9') ++p_;
      if (p_ == d) fail("expected digits");
    };
    if (p_ < t_.size() && t_[p_] == '0') {
      ++p_;
    } else {
      digits();
    }
    if (p_ < t_.size() && t_[p_] == '.') {
      ++p_;
      digits();
    }
    if (p_ < t_.size() && (t_[p_] == 'e' || t_[p_] == 'E')) {
      ++p_;
      if (p_ < t_.size() && (t_[p_] == '+' || t_[p_] == '-')) ++p_;
      digits();
    }
    value v;
    v.k = value::kind::number;
    v.n = std::strtod(std::string(t_.substr(start, p_ - start)).c_str(), nullptr);
    return v;
  }

  std::string_view t_;
  std::size_t p_ = 0;
};

inline value parse(std::string_view text) { return parser(text).parse(); }

}  // namespace mini_json
